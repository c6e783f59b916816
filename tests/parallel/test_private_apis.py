"""Every private torch/Hydra API xpar relies on still exists where xpar reads it
(xpar.parallel.torch_internals, xpar.config.hydra_internals): a torch or Hydra upgrade that moves one fails here,
by name, instead of deep inside a run."""
import inspect

import pytest
import torch


def test_schedule_ops_builds_an_action_list_offline():
    from xpar.parallel.torch_internals import schedule_ops
    ops = schedule_ops("1F1B", 2, 2, None)
    assert len(ops) == 2 and any(a is not None and a.computation_type.value == "F" for a in ops[0])


def test_fake_store_and_replicate_and_dispatch_mode():
    import torch.distributed as dist

    from xpar.parallel import torch_internals as tp
    assert isinstance(tp.fake_store(), dist.Store)
    assert callable(tp.composable_replicate())
    assert inspect.isclass(tp.dispatch_mode_base())
    assert hasattr(tp.functional_collectives(), "all_reduce")
    assert tp.in_backward() is False and tp.is_higher_order_op(torch.add) is False
    assert tp.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]
    from torch.nn.parallel import DistributedDataParallel
    assert callable(getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None))


def test_fsdp_private_fields_are_where_xpar_reads_them():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    src = inspect.getsource(FSDPParam)
    assert "_unsharded_param" in src and "unsharded_accumulated_grad" in src
    assert "_get_fsdp_state" in dir(FSDPModule)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    assert "_fsdp_param_groups" in inspect.getsource(FSDPState)


def test_device_mesh_flatten_exists():
    from torch.distributed.device_mesh import DeviceMesh
    assert callable(getattr(DeviceMesh, "_flatten", None))


def test_schedule_loss_hook_and_sac_storage_exist():
    from torch.distributed.pipelining import schedules
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    assert hasattr(schedules.PipelineScheduleSingle, "_compute_loss")
    fwd, rec = create_selective_checkpoint_contexts(lambda *a, **k: None)
    assert hasattr(fwd, "storage") and hasattr(rec, "storage")


def test_hydra_sweep_expansion():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from xpar.config.hydra_internals import split_sweep_arguments
    parser = OverridesParser.create()
    batches = split_sweep_arguments(parser.parse_overrides(["a=1,2", "b=x"]))
    assert sorted(map(tuple, batches[0])) == [("a=1", "b=x"), ("a=2", "b=x")]



def test_hydra_applies_value_overrides_in_place():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from xpar.config.hydra_internals import apply_value_overrides
    cfg = OmegaConf.create({"a": {"b": 1}})
    OmegaConf.set_struct(cfg, True)
    apply_value_overrides(OverridesParser.create().parse_overrides(["a.b=2"]), cfg)
    assert cfg.a.b == 2

@pytest.mark.parametrize("module", ["xpar.parallel.torch_internals", "xpar.config.hydra_internals"])
def test_private_modules_import_their_libraries_lazily(module):
    import importlib
    mod = importlib.import_module(module)
    assert "import torch\n" not in inspect.getsource(mod).split("def ", 1)[0]


def test_mlflow_schema_head_is_where_the_store_seed_reads_it():
    """xpar.track.store_seed compares its template's Alembic revision with MLflow's head (without it,
    seeding is skipped and MLflow builds each store itself: slower, never wrong)."""
    from mlflow.store.db.utils import _get_latest_schema_revision
    head = _get_latest_schema_revision()
    assert isinstance(head, str) and len(head) >= 8
