"""The cost-model registry: one list of names for tune, the benchmarks and the CLI help."""

import pytest

from cwm.errors import CwmError
from cwm.tuning.registry import check_cost_model, cost_model_help, cost_model_names, create_cost_model


def test_every_cost_model_is_registered_once_and_named_in_the_help():
    names = cost_model_names()
    assert names == ("cwm", "xgb", "xgb-pretrained", "random", "cwm-zscore", "cwm-boost-copy")
    assert all(f"{n}:" in cost_model_help() for n in names)


def test_the_cli_help_lists_the_registered_cost_models():
    from typer.testing import CliRunner

    from cwm.cli import app

    out = CliRunner().invoke(app, ["tune", "--help"], terminal_width=400).output
    assert "xgb-pretrained" in out


def test_an_unknown_cost_model_is_a_clear_error():
    with pytest.raises(CwmError, match="unknown cost model 'xgboost'; choose one of cwm, xgb, xgb-pretrained"):
        check_cost_model("xgboost")
    with pytest.raises(CwmError, match="unknown cost model"):
        create_cost_model("xgboost")


def test_created_cost_models_are_timed_and_of_their_kind(tmp_path):
    import tvm.s_tir.meta_schedule as ms

    from cwm.tuning.cost_model import TimedCostModel

    random = create_cost_model("random", seed=3)
    assert isinstance(random, TimedCostModel) and isinstance(random.inner, ms.cost_model.RandomModel)
    assert isinstance(create_cost_model("xgb").inner, ms.cost_model.XGBModel)
    with pytest.raises(CwmError, match="needs a saved XGBModel file"):
        create_cost_model("xgb-pretrained", tmp_path / "missing.tar")
    junk = tmp_path / "junk.tar"
    junk.write_text("not a tar")
    with pytest.raises(CwmError, match="is not a saved XGBModel"):
        create_cost_model("xgb-pretrained", junk)
    with pytest.raises(CwmError, match="only the cwm cost model has a transition"):
        create_cost_model("xgb", finetune_transition=True)


def test_the_world_model_cost_model_takes_a_shipped_model_by_name():
    from cwm.tuning.cost_model import WorldModelCostModel

    model = create_cost_model("cwm", "default")
    assert isinstance(model.inner, WorldModelCostModel)
    assert "znver3" in model.inner.model.config.trained_on["machines"]
