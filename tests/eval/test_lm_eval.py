"""lm-eval integration: `qkv lm-eval` (CLI) and simple_evaluate through the fp8 engine give the same numbers.

Needs the ``lm-eval`` extra, which ``.ci/run`` installs (``pip install -e '.[test,triton,lm-eval]'``).
"""

from __future__ import annotations

import json

import pytest

from qkv.cli import main

PAGES = [
    " = Paged attention = \n Paged attention stores keys and values in fixed blocks of sixteen tokens . "
    "The quick brown fox jumps over the lazy dog . \n",
    " = Eight bit caches = \n An eight bit cache holds twice the tokens in the same memory . Calibration "
    "observes the keys after rotary embedding and the values as projected . \n",
]


@pytest.fixture()
def wikitext_jsonl(tmp_path, monkeypatch):
    p = tmp_path / "pages.jsonl"
    p.write_text("".join(json.dumps({"page": x}) + "\n" for x in PAGES))
    monkeypatch.setenv("QKV_WIKITEXT_JSONL", str(p))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return p


def _metrics(results: dict) -> dict:
    out = {}
    for task, res in results["results"].items():
        for k, v in res.items():
            if isinstance(v, float) and "stderr" not in k:
                out[f"{task}/{k}"] = v
    return out


def test_cli_and_simple_evaluate_agree_through_fp8(tiny_dir, wikitext_jsonl, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from qkv.eval.lm_eval_model import QKVLM, TASKS_DIR

    model = str(tiny_dir("llama"))
    out = tmp_path / "out"
    code = main(
        [
            "lm-eval",
            "--model_args",
            f"pretrained={model},kv_cache_dtype=fp8,kv_cache_memory=16MiB",
            "--tasks",
            "qkv_wikitext,qkv_mc",
            "--output_path",
            str(out),
        ]
    )
    assert code == 0
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    cli = _metrics(json.loads(files[0].read_text()))

    lm = QKVLM(pretrained=model, kv_cache_dtype="fp8", kv_cache_memory="16MiB")
    assert lm.engine.cache.dtype_summary() == "fp8_e4m3 x3"
    res = simple_evaluate(
        model=lm, tasks=["qkv_wikitext", "qkv_mc"], task_manager=TaskManager(include_path=str(TASKS_DIR))
    )
    api = _metrics(res)
    assert set(cli) == set(api) and {"qkv_wikitext/word_perplexity,none", "qkv_mc/acc,none"} <= set(cli)
    for k in cli:
        assert cli[k] == pytest.approx(api[k], rel=1e-9), k
    assert res["results"]["qkv_mc"]["alias"] == "qkv_mc"


def test_model_args_reach_the_engine_and_generate_until(tiny_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import qkv.eval.lm_eval_model  # noqa: F401 - registers "qkv"

    assert get_model("hf").__name__ == "HFLM"  # built-in models survive the registration
    cls = get_model("qkv")
    lm = cls.create_from_arg_string(
        f"pretrained={tiny_dir('gemma3')},kv_cache_dtype=fp8,"
        f"kv_cache_dtype_skip_layers=sliding_window,kv_cache_memory=16MiB,max_length=256"
    )
    assert lm.engine.cache.dtype_summary() == "bfloat16 x2 + fp8_e4m3 x1"
    assert lm.max_length == 256
    reqs = [
        Instance("generate_until", {}, ("The quick brown", {"until": ["."], "max_gen_toks": 8}), 0),
        Instance("generate_until", {}, ("Paged attention", {"max_gen_toks": 5, "do_sample": False}), 1),
    ]
    outs = lm.generate_until(reqs, disable_tqdm=True)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs) and "." not in outs[0]
    again = lm.generate_until(reqs, disable_tqdm=True)
    assert outs == again  # greedy and deterministic
    ll = lm.loglikelihood([Instance("loglikelihood", {}, ("The quick", " brown fox"), 0)], disable_tqdm=True)
    assert ll[0][0] < 0
