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
    from cwm.tuning.collect import collect

    db = tmp_path_factory.mktemp("tinydb")
    collect([tiny_task], db, n_random=8, n_evolutionary=8, batch=8, progress=False)
    return db


MULTI = ["matmul:M=32,N=32,K=32", "dense_relu:M=16,N=32,K=32", "softmax:M=32,N=64",
         "batch_matmul:B=2,M=16,N=16,K=16"]


@pytest.fixture(scope="session")
def multi_db(tmp_path_factory):
    """Four tiny tasks with 12 measured candidates each."""
    from cwm.tuning.collect import collect
    from cwm.workloads import get_task

    db = tmp_path_factory.mktemp("multidb")
    collect([get_task(n) for n in MULTI], db, n_random=8, n_evolutionary=4, batch=8, progress=False)
    return db


@pytest.fixture(scope="session")
def multi_split(multi_db, tmp_path_factory):
    import json

    from cwm.data.dataset import load_dataset

    ds = load_dataset(multi_db)
    by_name = {info.name: tid for tid, info in ds.tasks.items()}
    split = {"train": [by_name[MULTI[0]], by_name[MULTI[1]]], "val": [by_name[MULTI[2]]],
             "test": [by_name[MULTI[3]]]}
    path = tmp_path_factory.mktemp("split") / "split.json"
    path.write_text(json.dumps(split))
    return path


@pytest.fixture(scope="session")
def tiny_model(multi_db, multi_split, tmp_path_factory):
    from cwm.data.split import load_split
    from cwm.model.training import TrainSettings, train

    out = tmp_path_factory.mktemp("model")
    train(multi_db, load_split(multi_split), out, TrainSettings.tiny(), progress=False)
    return out
