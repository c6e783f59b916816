"""Run names, layout tags and run links as a user sees them in the MLflow UI (issue 45): every axis
above 1 is named, no degree of 1 is, a sweep's varying keys lead its children's names, and the
printed run link opens the model-training frame."""
from tests.conftest import spec_for
from xpar.track.report import layout_name
from xpar.track.naming import run_name, sweep_child_name, ui_hint, varying_keys


def test_an_ep2_run_names_ep2_in_its_name_and_layout_tag():
    spec = spec_for("model=moe_tiny", "parallel.ep=2", "parallel.dp=2")
    assert "ep2" in run_name(spec).split("·") and "-ep2" in layout_name(spec)
    assert run_name(spec) == "moe_tiny·ep2·dp2"


def test_sequence_parallelism_is_in_the_run_name():
    """parallel=tp with and without parallel.sequence_parallel=true were both named 'tiny·tp2'."""
    assert run_name(spec_for("model=tiny", "parallel=tp", "parallel.sequence_parallel=true")) == "tiny·tp2·sp"
    assert run_name(spec_for("model=tiny", "parallel=tp")) == "tiny·tp2"


def test_no_name_carries_a_degree_of_1():
    for overrides in [("parallel.dp=1",), ("parallel.dp=2",), ("parallel.dp=1", "parallel.cp=2"),
                      ("parallel.dp=1", "parallel.tp=2")]:
        name = run_name(spec_for("model=tiny", *overrides))
        assert not any(part[-1:] == "1" and part[:-1] in ("dp", "tp", "cp", "pp", "ep") for part in name.split("·")), name
    assert run_name(spec_for("model=tiny", "parallel.dp=1")) == "tiny"


def test_a_sweeps_varying_keys_lead_its_childrens_names():
    jobs = [["parallel=pp", "parallel.micro_batches=2"], ["parallel=pp", "parallel.micro_batches=8"]]
    assert varying_keys(jobs) == ["parallel.micro_batches"]
    name = sweep_child_name("mini·pp2·gpipe·m8", jobs[1], varying_keys(jobs), 1)
    assert name == "micro_batches=8·mini·pp2·gpipe·m8 #1"


def test_the_run_link_opens_the_training_frame():
    link = ui_hint("sqlite:///mlflow.db", "1", "abc")
    assert link.endswith("#/experiments/1/runs/abc?workflowType=machine_learning")
    assert ui_hint("http://h:5000/", "1", "abc") == "http://h:5000/#/experiments/1/runs/abc?workflowType=machine_learning"
