"""``qkv eval`` through a completions server: a real ``qkv serve`` as the configuration ``srv=URL``.

The server and the in-process baseline run the same tiny fp32 model, the server at one thread with the fixed
tiles of --batch-invariant, the in-process engine at the machine's thread count: their logprobs are fp32
rounding apart (measured: a ppl delta of 3e-6 %), so the server configuration must come out within 1e-3 % of
the baseline, with a KL below 1e-7 and every top-1 token the same, while an fp8 configuration of the same
run, scored in the same top-20 view, shows a loss. The server names tokens by id when asked
(return_tokens_as_token_ids), and an unreachable server is a clear error before any model loads.
"""

import json

import httpx
import pytest
from support.server import ServerProcess

from qkv.cli import main
from qkv.eval.configs import ConfigError, ServerConfig, parse_config
from qkv.eval.server import TOP_K


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return str(tiny_dir("llama"))


@pytest.fixture(scope="module")
def server(tiny):
    srv = ServerProcess(
        model=tiny,
        engine={"dtype": "float32", "batch_invariant": True, "num_blocks": 64},
        api_key="sk-eval",
        startup_timeout=120,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "text.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values. " * 60)
    return p


def test_server_configuration_equals_the_in_process_engine(server, tiny, text_file, tmp_path):
    out = tmp_path / "rep"
    code = main(
        [
            "eval",
            tiny,
            "--configs",
            f"auto,srv={server.url}/v1,fp8",
            "--dataset",
            str(text_file),
            "--num-windows",
            "3",
            "--window",
            "48",
            "--dtype",
            "float32",
            "--report",
            str(out),
            "--server-api-key",
            "sk-eval",
            "--ttft-lengths",
            "none",
            "--bootstrap",
            "200",
            "--max-ppl-delta",
            "50%",
        ]
    )
    r = json.loads((out / "report.json").read_text())
    assert code == 0 and r["baseline"] == "auto"
    srv, fp8 = r["accuracy"]["srv"], r["accuracy"]["fp8"]
    print(f"server vs in-process: ppl delta {srv['ppl_delta_pct']:.2e} %, KL {srv['kl_mean']:.2e}")
    assert abs(srv["ppl_delta_pct"]) < 1e-3 and srv["kl_mean"] < 1e-7 and srv["top1_agreement"] == 1.0
    assert srv["num_tokens"] == 3 * 47 == fp8["num_tokens"]
    assert fp8["kl_mean"] > 1e-5  # the 8-bit cache costs something, in the same view
    assert r["setup"]["servers"] == {"srv": f"{server.url}/v1"}
    assert r["setup"]["kl"].startswith(f"top-{TOP_K} KL") and r["latency"] is None
    assert [c.get("server") for c in r["configs"]] == [None, f"{server.url}/v1", None]
    assert "srv" not in r["memory"] and (out / "report.html").exists()


def test_server_answers_logprobs_as_token_ids(server):
    body = {
        "model": server_model(server),
        "prompt": [5, 6, 7, 8],
        "max_tokens": 1,
        "echo": True,
        "logprobs": 3,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
    }
    lp = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60).json()
    lp = lp["choices"][0]["logprobs"]
    assert lp["tokens"][:4] == ["token_id:5", "token_id:6", "token_id:7", "token_id:8"]
    assert lp["token_logprobs"][0] is None and all(k.startswith("token_id:") for k in lp["top_logprobs"][1])


def server_model(server) -> str:
    return httpx.get(server.url + "/v1/models", headers=server.headers, timeout=30).json()["data"][0]["id"]


def test_server_configuration_grammar():
    c = parse_config("vllm-fp8=http://127.0.0.1:8001/v1")
    assert c == ServerConfig("vllm-fp8=http://127.0.0.1:8001/v1", "vllm-fp8", "http://127.0.0.1:8001/v1")
    with pytest.raises(ConfigError, match="URL must be http"):
        parse_config("x=ftp://host/v1")
    with pytest.raises(ConfigError, match="NAME .before '='. must be"):
        parse_config("a b=http://h/v1")


def test_unreachable_server_is_a_clear_error(tiny, text_file, tmp_path, capsys):
    code = main(
        [
            "eval",
            tiny,
            "--configs",
            "auto,gone=http://127.0.0.1:9/v1",
            "--dataset",
            str(text_file),
            "--num-windows",
            "2",
            "--window",
            "32",
            "--dtype",
            "float32",
            "--report",
            str(tmp_path / "r"),
        ]
    )
    assert code == 2
    assert "qkv: error: server http://127.0.0.1:9/v1/models:" in capsys.readouterr().err
