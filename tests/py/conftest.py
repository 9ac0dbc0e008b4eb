"""Shared pytest setup for the Python tests: markers, the repo's python/ on sys.path, and the
locations of the `hetero` binary and a tokenizer, each skipping with a reason when absent."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long prompts (T=5003); deselect with -m 'not slow'")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """For `pytest -n N --dist loadgroup --no-loadscope-reorder` (`make test`): each module is one
    unit of work (its module-scoped stacks start once), except that every slow test is a unit of
    its own and comes first, so the longest runs start at once beside the rest."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    for item in items:
        group = item.nodeid if item.get_closest_marker("slow") else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def hetero_bin() -> Path:
    """The C++ `hetero` binary: $HETERO_BIN, else build/hetero in this repo."""
    path = Path(os.environ.get("HETERO_BIN") or REPO / "build" / "hetero")
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"no hetero binary at {path} (build it, or set HETERO_BIN)")
    return path


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A directory with a real model's tokenizer files, for tiny-llama checkpoints."""
    path = os.environ.get("HETERO_TOKENIZER")
    if not path:
        pytest.skip("HETERO_TOKENIZER is not set (a directory with tokenizer.json, e.g. SmolLM2's)")
    if not (Path(path) / "tokenizer.json").exists():
        pytest.skip(f"HETERO_TOKENIZER={path} has no tokenizer.json")
    return Path(path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With HETERO_NO_SKIPS=1 (`make test` sets it) a skipped test fails the run: a test the
    suite is meant to run that skips (a missing model, binary or variable) would otherwise pass
    silently."""
    if os.environ.get("HETERO_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if not skipped:
        return
    reporter.write_line(f"HETERO_NO_SKIPS=1: {len(skipped)} test(s) skipped; failing the run:",
                        red=True)
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reporter.write_line(f"  {report.nodeid}: {reason}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
