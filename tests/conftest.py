import os

import pytest

# Keep the library's own thread pools small: CI has 2 cores.
os.environ.setdefault("TVM_NUM_THREADS", "2")

TINY = "matmul:M=32,N=32,K=32"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow benchmarks too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow benchmark: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_task():
    from cwm.workloads import get_task

    return get_task(TINY)


@pytest.fixture(scope="session")
def tiny_db(tmp_path_factory, tiny_task):
    """A database with 8 random + 8 evolutionary candidates of the tiny task (shared by tests)."""
    from cwm.collect import collect

    db = tmp_path_factory.mktemp("tinydb")
    collect([tiny_task], db, n_random=8, n_evolutionary=8, batch=8, progress=False)
    return db
