import os
from pathlib import Path

import pytest
import torch

# Triton decides at decoration time whether to interpret: set this before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.tiny_models import make_tiny_model  # noqa: E402 - tests/ is on the path (pytest's pythonpath)

from qkv.data_files import find_data_file, not_found  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir("llama")`` -> path of a tiny random checkpoint, built once per session."""
    base = tmp_path_factory.mktemp("tiny")

    def make(arch: str) -> Path:
        return make_tiny_model(arch, base / arch)

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: a step of a 64-wide model is microseconds of
    work, and on a busy 2-core machine torch's thread pool spends ~100x that waiting for its threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data_file():
    """``data_file("wikitext-2/wiki.test.raw")`` -> its path, found by :mod:`qkv.data_files`' rule.

    A missing file FAILS the test, naming every path looked at: CI has the shared copy, so the
    tests behind the README's numbers can never pass there by skipping. Outside CI,
    ``QKV_ALLOW_MISSING_DATA=1`` turns the failure into a skip that says why.
    """

    def find(name: str) -> Path:
        path = find_data_file(name)
        if path is None:
            msg = not_found(name)
            if os.environ.get("QKV_ALLOW_MISSING_DATA") == "1" and os.environ.get("CI") != "true":
                pytest.skip(f"{msg} (QKV_ALLOW_MISSING_DATA=1)")
            pytest.fail(f"{msg}; outside CI, QKV_ALLOW_MISSING_DATA=1 skips the tests that need it", pytrace=False)
        return path

    return find


def pytest_collection_modifyitems(config, items):
    # Real-model tests pull and convert checkpoints on first use, and the compile check takes minutes;
    # QKV_SKIP_SLOW=1 leaves both out of a quick local run. Never in CI (CI=true), where every test runs.
    if os.environ.get("QKV_SKIP_SLOW") == "1" and os.environ.get("CI") != "true":
        skip = pytest.mark.skip(reason="slow or compile test left out of a quick local run (QKV_SKIP_SLOW=1)")
        for item in items:
            if "slow" in item.keywords or "compile" in item.keywords:
                item.add_marker(skip)


_RECORDS = pytest.StashKey[list]()


@pytest.fixture
def record(request):
    """``record("line")``: a line for the end of the run's summary (CI's log shows it; captured prints are
    shown only for failures). For counts a must-show asks to see: fuzz cases, kills, scrapes."""
    lines = request.config.stash.setdefault(_RECORDS, [])
    return lambda line: lines.append(f"{request.node.nodeid}: {line}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_RECORDS, [])
    if lines:
        terminalreporter.section("recorded")
        for line in lines:
            terminalreporter.write_line(line)
