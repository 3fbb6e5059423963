"""``/openapi.json``, and schemathesis reading it: a fuzzer nobody here wrote, against a real ``qkv serve``.

schemathesis (from PyPI) generates requests from the published schema alone, valid and invalid, for every
operation, and runs all of its checks on the answers: no 5xx, every status and content type documented,
every body (SSE events included) valid against the response schema, schema-valid bodies accepted and
schema-invalid ones refused, auth enforced where the schema says so. Its only input from qkv besides the
schema is the filter of the four rules that relate two fields (``support.schemathesis_hooks``).
"""

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.server import ServerProcess, running_app

from qkv.sampling import MAX_SAMPLES

KEY = "fuzz-key"
MAX_MODEL_LEN = 128  # the schema bounds max_tokens by it: every generated completion stays short
ENGINE = {"dtype": "float32", "kv_cache_dtype": "fp8", "num_blocks": 64, "max_model_len": MAX_MODEL_LEN}
MAX_EXAMPLES = 30  # per operation and phase; the coverage phase adds its boundary cases on top
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def chat_model(tiny_dir, tmp_path_factory) -> str:
    """The tiny model with a chat template that takes any role, so that every chat body the schema allows
    can be served (real templates refuse some role orders, which a schema cannot state)."""
    src, dst = tiny_dir("llama"), tmp_path_factory.mktemp("openapi") / "tiny-chat"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "chat_template.jinja").write_text(TEMPLATE)
    return str(dst)


def test_openapi_json_needs_the_key_and_states_the_served_limits(tiny_dir, one_thread):
    engine = {"dtype": "float32", "num_blocks": 64, "max_model_len": 256, "max_num_seqs": 8}

    async def fetch() -> dict:
        async with running_app(str(tiny_dir("llama")), engine, api_key="k") as (c, _):
            assert (await c.get("/openapi.json")).status_code == 401  # auth applies as it does to /v1
            return (await c.get("/openapi.json", headers={"Authorization": "Bearer k"})).json()

    doc = asyncio.run(fetch())
    # the tiny model has no chat template: every chat request would be refused, so chat is not published
    assert sorted(doc["paths"]) == ["/health", "/metrics", "/v1/completions", "/v1/models", "/version"]
    assert doc["paths"]["/health"]["get"]["security"] == [] and "401" not in doc["paths"]["/health"]["get"]["responses"]
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["security"] == [{"bearer": []}]
    assert sorted(post["responses"]) == ["200", "400", "401", "404", "413", "503"]
    assert sorted(post["responses"]["200"]["content"]) == ["application/json", "text/event-stream"]
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["model"]["anyOf"][0] == {"type": "string", "enum": ["tiny"]}
    assert props["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 8}  # max_num_seqs < MAX_SAMPLES
    assert MAX_SAMPLES == 128
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 255
    token_ids = props["prompt"]["anyOf"][1]["items"]
    assert token_ids == {"type": "integer", "minimum": 0, "maximum": 383}  # the tiny vocabulary: 384
    assert props["presence_penalty"]["anyOf"][0] == {"const": 0}


def _schemathesis(url: str, model: str, report: Path) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("schemathesis")
    cmd = [str(cli), "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {KEY}", "--checks", "all"]
    cmd += ["--mode", "all", "--max-examples", str(MAX_EXAMPLES), "--seed", "0", "--no-color"]
    cmd += ["--request-timeout", "120"]  # a batch of prompts with n samples each is seconds on a slow machine
    cmd += ["--report", "junit", "--report-dir", str(report)]
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1]),
        "SCHEMATHESIS_HOOKS": "support.schemathesis_hooks",
        "QKV_FUZZ_MODEL": model,
        "QKV_FUZZ_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
    }
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=report)


def test_schemathesis_finds_no_failure_in_any_operation(chat_model, tmp_path, record):
    srv = ServerProcess(model=chat_model, engine={**ENGINE, "max_num_seqs": 4}, api_key=KEY)
    try:
        run = _schemathesis(srv.url, chat_model, tmp_path)
        summary = run.stdout[run.stdout.find("SUMMARY") :]
        print(summary)
        assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
        assert "Operations:       6 selected / 6 total" in run.stdout  # chat is published: the model has a template
        generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", summary).groups())
        assert generated == passed > 6 * MAX_EXAMPLES
        assert "No issues found" in summary
        record(f"schemathesis {run.stdout.split()[1]}: {generated} cases generated, {passed} passed, no issues")
        # the server took it all and is intact: healthy, and no request still holds a KV block
        assert srv.client().get("/health").status_code == 200
        kv = srv.wait_idle()
        assert kv["num_referenced_blocks"] == 0 and kv["num_running"] == kv["num_waiting"] == 0
    finally:
        srv.stop()
