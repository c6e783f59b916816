"""What xpar prints for a reader (issue 45): `xpar compare`'s cells in their units (not 0.009 GiB or MFU as
a fraction) and near-miss overrides answered with a suggestion that works."""
from xpar.track.compare import HEADERS, cell


def test_cells_read_in_their_units():
    assert cell("peak_gib_per_device", 9.07 / 1024) == "9.07 MiB"
    assert cell("mfu", 0.316) == "31.6%"
    assert cell("step_time_s", 0.0858) == "85.8 ms"
    assert cell("tokens_per_s", 6543.2) == "6,543" and cell("devices", 8.0) == "8"
    assert cell("bubble_theory", 0.1111) == "0.111" and cell("mfu", float("nan")) == ""
    assert HEADERS["mfu"] == "MFU" and "bubble_theory" not in HEADERS


def test_near_misses_get_a_suggestion_that_works():
    """`xpar run ...`, parallel=zer3 and parallel.schedule=1F1B were refused without one."""
    from tests.conftest import compose
    from xpar.config.checks.config import check_choices
    from xpar.config.overrides import override_problems

    assert "a run needs no command word: `xpar parallel=zero3`" in override_problems(["run", "parallel=zero3"])[0]
    assert "did you mean parallel=zero3?" in override_problems(["parallel=zer3"])[0]
    from omegaconf import OmegaConf
    from xpar.config.schema import XparConfig
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(XparConfig), compose("parallel.schedule=1F1B")))
    assert any("did you mean parallel.schedule=1f1b?" in p for p in check_choices(cfg))


def test_a_sweep_over_presets_with_a_typo_is_told_the_whole_sweep():
    """-m parallel=dp,zero4,zero3 was told 'did you mean parallel=zero3?': followed, one job where three were asked.
    Each unknown value is replaced by its closest preset, the rest kept; the line it gives passes."""
    from xpar.config.overrides import override_problems

    problems = override_problems(["-m", "parallel=dp,zero4,zro1"])
    assert len(problems) == 2 and all("did you mean parallel=dp,zero3,zero1?" in p for p in problems), problems
    assert override_problems(["-m", "parallel=dp,zero3,zero1"]) == []
    assert "did you mean parallel=dp,zero3?" in override_problems(["-m", "parallel=dp,zero4,zero3"])[0]
    # a misspelt key or group of a sweep keeps the sweep's values (was 'did you mean parallel.tp=...?')
    assert override_problems(["-m", "parallel.tpp=1,2"])[0].endswith("did you mean parallel.tp=1,2?")
    assert override_problems(["-m", "paralel=dp,zero3"])[0].endswith("did you mean parallel=dp,zero3?")
    assert override_problems(["-m", "parallel.tp=1,2", "parallel=dp,zero3"]) == []
    # a group outside the defaults list keeps its '+' (experiment=foo was told 'write experiment=<one of ...>')
    assert "write +experiment=<one of bubble_vs_microbatches," in override_problems(["experiment=foo"])[0]
    assert override_problems(["+experiment=zero_memory"]) == []


def test_both_memory_charts_colour_each_term_alike():
    """The estimate's memory figure and xpar compare's draw the same term in the same colour, even
    where compare leaves out a term that is zero for every run."""
    import pandas as pd
    from matplotlib.colors import to_hex

    from tests.conftest import spec_for
    from xpar.track.estimate_figures import memory_figure as estimate_figure
    from xpar.estimate.memory.per_device import memory
    from xpar.track.compare import headline_table, memory_figure

    runs = pd.DataFrame([{"run_id": "r0", "tags.mlflow.runName": "tiny", "tags.xpar.mode": "execute",
                          "tags.xpar.model": "tiny", "metrics.memory/peak_bytes_per_device": 8e6,
                          "metrics.memory/params_bytes": 1e6, "metrics.memory/activations_bytes": 7e6}])

    def colours(fig):
        ax = fig.axes[0]
        pairs = zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)
        return {t.get_text(): to_hex(h.get_facecolor()) for t, h in pairs if hasattr(h, "get_facecolor")}
    compared = colours(memory_figure(runs, headline_table(runs)))
    estimated = colours(estimate_figure([memory(spec_for("model=tiny"))], "t"))
    assert set(compared) == {"params", "activations"}
    assert all(compared[k] == estimated[k] for k in compared), (compared, estimated)
