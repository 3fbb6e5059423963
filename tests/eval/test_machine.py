"""What a benchmark JSON records about where it ran: the commit measured, marked when the code was not committed."""

import subprocess
from pathlib import Path

from qkv.eval.machine import FLAGS, cpu_info, source_commit, write_report


def git(root: Path, *args: str) -> str:
    cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_marked_dirty_while_tracked_files_differ(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "kernel.h").write_text("a\n")
    git(tmp_path, "add", "kernel.h")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    (tmp_path / "results.json").write_text("{}")  # untracked output: still the commit's code
    assert source_commit(tmp_path) == head
    (tmp_path / "kernel.h").write_text("b\n")
    assert source_commit(tmp_path) == head + "+dirty"


def test_no_commit_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # wherever the temporary folder lies
    assert source_commit(tmp_path) is None


def test_no_commit_for_a_copy_inside_another_repository(tmp_path):
    """A non-editable install in a venv inside a user's project is not that project's code."""
    git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("a project\n")
    git(tmp_path, "add", "README")
    git(tmp_path, "commit", "-q", "-m", "one")
    installed = tmp_path / ".venv" / "site-packages" / "qkv"
    installed.mkdir(parents=True)
    assert source_commit(tmp_path) is not None
    assert source_commit(installed) is None


def test_the_report_keeps_a_commit_taken_at_the_start(tmp_path):
    out = tmp_path / "r.json"
    report = {"env": {"cpu": cpu_info(), "qkv_commit": "abc1234"}}
    write_report(report, out)
    assert report["env"]["qkv_commit"] == "abc1234" and len(report["env"]["load_average_after"]) == 3
    report = {"env": {}}
    write_report(report, out)
    assert report["env"]["qkv_commit"] == source_commit()
    assert set(cpu_info()["flags"]) <= set(FLAGS)
