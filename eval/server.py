"""``qkv eval`` through OpenAI-compatible completion servers: the accuracy of what users actually deploy.

A configuration ``NAME=URL`` in ``--configs`` is a server (``vllm serve``, SGLang, ``qkv serve``; URL is its
``/v1`` base). Each window goes to ``POST {URL}/completions`` with its token ids as the prompt,
``max_tokens=1``, ``echo=true``, ``logprobs=20`` and ``return_tokens_as_token_ids=true`` (vLLM's and qkv's
extension, so that tokens are ids, not strings two tokenizers may spell alike): the server returns, for every
prompt position, the logprob of the actual token and its 20 most likely tokens. In-process configurations of
the same run are reduced to the same view (their top 20 from the full logits), so every configuration is
measured alike:

* perplexity from the actual tokens' logprobs, with the paired bootstrap interval of the ppl delta;
* top-1 agreement: the configuration's most likely token equals the baseline's;
* **top-20 KL**: KL(p || q) over the baseline's 20 most likely tokens at each position, both distributions
  renormalized over those 20; a token missing from the configuration's top 20 takes its 20th logprob, an upper
  bound of its own. It converges to the full KL as the baseline's top 20 hold its mass (they hold most of it
  for a 135M model on WikiText-2), and it is the number the report states as ``kl_mean``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from qkv.scoring import prefill_logits

from .accuracy import ConfigTokens

__all__ = ["TOP_K", "EngineScorer", "ServerScorer", "score_windows_topk", "topk_metrics"]

TOP_K = 20  # OpenAI's largest logprobs; the KL's truncation


class ServerScorer:
    """One completions server: per window, the actual tokens' logprobs and the top ``TOP_K`` at each position."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        models = self._call("GET", "/models")["data"]
        if not models:
            raise ValueError(f"server {self.url}: /models lists no model")
        self.model = models[0]["id"]

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise ValueError(f"server {self.url}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"server {self.url}{path}: {e}") from None

    def topk(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "echo": True,
            "logprobs": TOP_K,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        lp = self._call("POST", "/completions", body)["choices"][0]["logprobs"]
        n = len(ids) - 1  # position 0 has no logprob; the generated token after the prompt is not scored
        target = np.array(lp["token_logprobs"][1 : n + 1], dtype=np.float64)
        top_ids = np.zeros((n, TOP_K), dtype=np.int64)
        top_lp = np.full((n, TOP_K), -np.inf)
        for i, row in enumerate(lp["top_logprobs"][1 : n + 1]):
            best = sorted(row.items(), key=lambda kv: -kv[1])[:TOP_K]
            for j, (tok, value) in enumerate(best):
                top_ids[i, j] = _token_id(tok)
                top_lp[i, j] = value
        if len(target) != n or not np.isfinite(target).all():
            raise ValueError(f"server {self.url}: echoed {len(target)} logprobs for a {len(ids)}-token prompt")
        return target, top_ids, top_lp


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"the server ignored return_tokens_as_token_ids (got the token {token!r})")
    return int(token.split(":", 1)[1])


class EngineScorer:
    """An in-process qkv engine, reduced to the servers' view (the top ``TOP_K`` of its full logits)."""

    def __init__(self, engine, chunk_size: int | None = None) -> None:
        self.engine = engine
        self.chunk_size = chunk_size

    def topk(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits = prefill_logits(self.engine, ids, chunk_size=self.chunk_size)
        assert logits is not None
        logp = torch.log_softmax(logits[:-1].float(), -1)
        target = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        top_lp, top_ids = logp.topk(TOP_K, dim=-1)
        return target.double().numpy(), top_ids.numpy(), top_lp.double().numpy()


def topk_metrics(base: tuple, cfg: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the configuration's NLL, its top-20 KL from the baseline, and top-1 agreement."""
    target, top_ids, top_lp = cfg
    _, b_ids, b_lp = base
    q = np.empty_like(b_lp)
    for i in range(len(b_ids)):  # the configuration's logprob of each of the baseline's top tokens
        mine = dict(zip(top_ids[i].tolist(), top_lp[i].tolist()))
        floor = top_lp[i, -1]
        q[i] = [mine.get(t, floor) for t in b_ids[i].tolist()]
    lp = b_lp - np.logaddexp.reduce(b_lp, axis=1, keepdims=True)  # renormalized over the baseline's top 20
    lq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    return -target, np.maximum(kl, 0.0), (top_ids[:, 0] == b_ids[:, 0]).astype(np.int64)


def score_windows_topk(scorers: dict, windows: list[list[int]], baseline: str) -> dict[str, ConfigTokens]:
    """Every window through every configuration (baseline first), in the servers' top-k view."""
    out = {label: ConfigTokens() for label in scorers}
    order = [baseline] + [k for k in scorers if k != baseline]
    for ids in windows:
        base = None
        for label in order:
            t0 = time.perf_counter()
            got = scorers[label].topk(ids)
            base = got if base is None else base
            nll, kl, agree = topk_metrics(base, got)
            acc = out[label]
            acc.seconds += time.perf_counter() - t0
            acc.nll_sum.append(float(nll.sum()))
            acc.num_tokens.append(int(nll.size))
            acc.kl_sum.append(float(kl.sum()))
            acc.top1_sum.append(int(agree.sum()))
            acc.kl_tokens.append(kl.astype(np.float32))
    return out
