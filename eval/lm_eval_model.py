"""An lm-evaluation-harness (0.4.x) model that runs every request through the qkv engine.

Registered as ``qkv``::

    qkv lm-eval --model_args pretrained=smollm2-135m,kv_cache_dtype=fp8,kv_scales=DIR \\
        --tasks qkv_wikitext,qkv_mc
    simple_evaluate(model=QKVLM(pretrained="smollm2-135m", kv_cache_dtype="fp8"), tasks=[...])

``model_args``: ``pretrained`` (registry name or HF directory), the scorer's ``max_length``,
``max_gen_toks``, ``add_bos_token`` and ``seed``, and any field of the engine's ``EngineConfig``
(``kv_cache_dtype``, ``kv_scales``, ``kv_rotation``, ``kv_cache_memory``, ...; ``kv_cache_dtype_skip_layers``
takes ``sliding_window`` and/or indices separated by ``/`` or ``;``, since commas separate model args).
Anything else is an error that names it.

Log-likelihoods are computed like lm-eval's ``hf`` model (same tokenization,
same left truncation to ``max_length + 1`` tokens, same rolling windows), but the
logits come from :func:`qkv.scoring.prefill_logits`, write-then-attend through
the (quantized) paged cache. ``generate_until`` batches all requests through the
engine's continuous batching (greedy unless ``do_sample``).
"""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path

import lm_eval.models  # noqa: F401  - registers the built-in models first; registering before drops them
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
from tqdm import tqdm

from qkv.config import EngineConfig
from qkv.llm import LLM
from qkv.options import option_default
from qkv.sampling import SamplingParams
from qkv.scoring import prefill_logits

from .run import EvalArgs

__all__ = ["QKVLM", "register", "TASKS_DIR", "parse_skip"]

logger = logging.getLogger("qkv.eval")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def parse_skip(value) -> list | None:
    """``"sliding_window/0;5"`` -> ``["sliding_window", 0, 5]``; lists and ints pass through."""
    if value is None or value == "":
        return None
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    out = []
    for part in str(value).replace(";", "/").replace(" ", "/").split("/"):
        if part:
            out.append(int(part) if part.isdigit() else part)
    return out


# model_args that are lm-eval's (the harness passes some to every model) or the scorer's, not the engine's
_HARNESS_ARGS = frozenset({"batch_size", "max_batch_size"})
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}


class QKVLM(TemplateLM):
    def __init__(
        self,
        pretrained: str,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        seed: int = 1234,
        **model_args,
    ) -> None:
        """``model_args`` are EngineConfig's fields (``kv_cache_dtype``, ``kv_scales``, ...), with qkv eval's
        defaults for ``dtype`` and ``kv_cache_memory`` (:class:`~qkv.eval.run.EvalArgs`), checked by EngineConfig;
        lm-eval's own ``batch_size``/``max_batch_size`` are accepted and ignored (requests run one at a time,
        continuous batching does the rest)."""
        super().__init__()
        unknown = sorted(set(model_args) - _ENGINE_FIELDS - _HARNESS_ARGS)
        if unknown:
            raise ValueError(f"qkv lm-eval model: unknown model_args {unknown}; EngineConfig's fields are accepted")
        engine = {k: v for k, v in model_args.items() if k in _ENGINE_FIELDS and v not in (None, "")}
        engine.setdefault("dtype", option_default(EvalArgs, "dtype"))
        engine.setdefault("kv_cache_memory", option_default(EvalArgs, "kv_cache_memory"))
        if "kv_cache_dtype_skip_layers" in engine:
            engine["kv_cache_dtype_skip_layers"] = parse_skip(engine["kv_cache_dtype_skip_layers"])
        device = engine.get("device")
        if device in ("auto",) or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            engine.pop("device")  # lm-eval's CLI passes device="cuda" by default; the engine picks cuda or cpu
        self.llm = LLM(str(pretrained), **engine)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.engine.tokenizer
        self._max_length = int(max_length) if max_length else self.engine.max_model_len
        if self._max_length > self.engine.max_model_len:
            raise ValueError(
                f"max_length {self._max_length} exceeds the engine's max_model_len "
                f"{self.engine.max_model_len}; raise kv_cache_memory or max_model_len"
            )
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.seed = seed
        self.batch_size = model_args.get("batch_size", 1)

    # -- what TemplateLM needs -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs
    ) -> list[int]:
        """As lm-eval's ``hf`` model: the tokenizer's default special tokens, none when BOS is already there."""
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring ----------------------------------------------------------------
    def _score(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
        whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
        inp = whole[:-1]
        n = len(continuation_enc)
        logits = prefill_logits(self.engine, inp)[-n:]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(whole[-n:], dtype=torch.long)
        greedy = bool((logp.argmax(-1) == target).all())
        return float(logp.gather(1, target[:, None]).sum()), greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for key, context_enc, continuation_enc in tqdm(
            requests, disable=disable_tqdm or len(requests) < 2, desc="qkv loglikelihood"
        ):
            if not continuation_enc:
                out.append((0.0, True))
                continue
            res = self._score(list(context_enc), list(continuation_enc))
            out.append(res)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="qkv rolling"):
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            total = sum(
                ll
                for ll, _ in self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            )
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # -- generation ---------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        engine = self.engine
        ids = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen = int(kw.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen} must be below max_length {self.max_length}")
            sampling = bool(kw.get("do_sample")) and float(kw.get("temperature", 1.0) or 0.0) > 0
            params = SamplingParams(
                temperature=float(kw.get("temperature", 1.0)) if sampling else 0.0,
                top_p=float(kw.get("top_p", 1.0) or 1.0),
                top_k=int(kw.get("top_k", 0) or 0),
                seed=self.seed + i if sampling else None,
                max_tokens=max_gen,
                stop=[s for s in until if s],
            )
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            ids.append((engine.add_request(prompt, params), until))
        done = {}
        bar = tqdm(total=len(ids), disable=disable_tqdm, desc="qkv generate_until")
        while len(done) < len(ids):
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].text
                    bar.update(1)
        bar.close()
        out = []
        for (rid, until), req in zip(ids, requests):
            text = done[rid]
            for s in until:  # the engine already stops at these; keep lm-eval's exact cut
                if s:
                    text = text.split(s)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def register(name: str = "qkv") -> type:
    """Register :class:`QKVLM` under ``name`` (after lm-eval's own models, which must stay)."""
    if name not in model_registry or model_registry.get(name) is not QKVLM:
        register_model(name)(QKVLM)
    return QKVLM


register()
