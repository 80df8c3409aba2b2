"""Every class of the package survives what copy.copy, pickle and torch.compile do to objects.

- Walk: every class defined in ``megatron_startrail`` (its Megatron modules included), made with
  ``__new__`` and no ``__init__`` (what pickle, ``copy.copy`` and dynamo's object builder
  make): attribute lookups, ``copy.copy``, a pickle round trip and ``repr`` may raise an ordinary
  error on such a blank object, never ``RecursionError``. On 3a17b64
  ``hasattr(BoundCall.__new__(BoundCall), "__dict__")`` recursed without end.
- Live objects: a bound kernel call copies and pickles and still answers its call's attributes
  and device views; the per-micro-batch cache pickles empty; StarTrailGroups copy (same process
  groups) and refuse pickling by name.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
import pkgutil

import pytest
import torch

import megatron_startrail
from megatron_startrail.megatron import cpu_patches
from tests.multiproc import run_ranks

cpu_patches.install_import_shims()


def _package_classes() -> list[type]:
    modules = [importlib.import_module(info.name)
               for info in pkgutil.walk_packages(megatron_startrail.__path__, "megatron_startrail.")
               if not info.name.endswith("__main__")]  # a command line: runs on import
    classes = {c for m in modules for _, c in inspect.getmembers(m, inspect.isclass)
               if c.__module__.startswith("megatron_startrail.")}
    return sorted(classes, key=lambda c: (c.__module__, c.__qualname__))


def _blank(cls):
    """``cls.__new__(cls)``, or None where the class refuses to be made that way (a named error)."""
    try:
        return cls.__new__(cls)
    except RecursionError:
        raise
    except Exception:  # noqa: BLE001 - e.g. a NamedTuple's required fields, a stand-in that always raises
        return None


def _uses(obj):
    yield "hasattr", lambda: (hasattr(obj, "__dict__"), hasattr(obj, "no_such_attribute"))
    yield "copy.copy", lambda: copy.copy(obj)
    yield "pickle", lambda: pickle.loads(pickle.dumps(obj))
    yield "repr", lambda: repr(obj)


def test_no_class_recurses_on_an_object_made_without_init():
    classes = _package_classes()
    assert len(classes) > 60, len(classes)  # the walk found the package
    made, recursed = 0, []
    for cls in classes:
        obj = _blank(cls)
        if obj is None:
            continue
        made += 1
        for use, run in _uses(obj):
            try:
                run()
            except RecursionError:
                recursed.append(f"{cls.__module__}.{cls.__qualname__}: {use}")
            except Exception:  # noqa: BLE001, S110 - a blank object may lack what a use reads; it must not recurse
                pass
    assert made > 60, made
    assert not recursed, recursed


def test_a_bound_kernel_call_copies_and_pickles():
    from megatron_startrail.layout import KernelCall  # noqa: PLC0415
    from megatron_startrail.microbatch import BoundCall  # noqa: PLC0415

    plain = KernelCall.back_to_back([(3, 5), (2, 2)], window=(-1, 0))
    view = torch.tensor([0, 3, 5], dtype=torch.int32)  # stands for the device buffer's view
    bound = BoundCall(plain, {(plain, "cu_seqlens_q", 1): view}, torch.device("cpu"))
    for other in (copy.copy(bound), pickle.loads(pickle.dumps(bound))):
        assert other.q_rows == plain.q_rows and other.window == (-1, 0)  # the call's, through __getattr__
        assert torch.equal(other.tensor("cu_seqlens_q", "cpu", 1), view)


def test_the_micro_batch_cache_pickles_empty():
    from megatron_startrail.microbatch import MicroBatchCache  # noqa: PLC0415

    cache, t = MicroBatchCache(capacity=3), torch.ones(2)
    assert cache.get("kind", [t], None, lambda: "value") == "value"
    restored = pickle.loads(pickle.dumps(cache))
    assert restored.capacity == 3 and restored.computed == 1 and not restored._entries
    assert restored.get("kind", [t], None, lambda: "again") == "again"  # works, computes anew


def groups_worker(rank, world_size):
    from megatron_startrail import new_startrail_groups  # noqa: PLC0415

    groups = new_startrail_groups(team_size=1)
    shallow = copy.copy(groups)
    same_groups = shallow.startrail_group is groups.startrail_group and shallow.config == groups.config
    with pytest.raises(TypeError) as refused:
        pickle.dumps(groups)
    return same_groups, str(refused.value)


def test_startrail_groups_copy_and_refuse_pickling_by_name():
    (same_groups, message), = run_ranks(groups_worker, 1)
    assert same_groups
    assert "process groups" in message and "new_startrail_groups" in message and "initialize_startrail" in message
