"""Per-micro-batch metadata: a packed-document GPT of 4 layers (standard attention, or
Multi-Latent Attention with its own RoPE table) makes at most one host sync and one agreement
collective per micro-batch in StarTrail's code, not one or more per layer.

On a GPU every host sync (``tolist``, ``item``, ``int(tensor)``, ``cpu``, ``torch.equal``, ...)
stalls the launch queue; Megatron computes per-micro-batch metadata once. CPU tensors cannot
show a stall, so the test counts the calls that would be one, made from megatron_startrail's
own frames (Megatron's own are Megatron's business), with a TorchFunctionMode.

A host-to-device copy (``torch.tensor(list, device=cuda)``, ``.to(cuda)`` of a CPU tensor, a
list used as an index) is one too where it is blocking, and a launch where it is not. CPU
tensors cannot show those either, so the second test runs one rank of P = 8 at full size on
the ``meta`` device (torch's fake process group, as benchmarks/counters/launch_budget.py does) and counts
every tensor built on the device from host data and every copy from the CPU to the device,
per layer and per micro-batch (:class:`DeviceCopyCounter`).
"""

import contextlib
import gc
import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.megatron.utils import HIDDEN, HEADS, VOCAB, Utils, parallel_state  # noqa: F401 (import shims first)
from tests.multiproc import run_ranks

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402

from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402

LAYERS, SEQ, MICRO_BATCHES = 4, 64, 3
# Tensor methods that wait for the device on a GPU (a data-dependent result on the host).
SYNCS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "equal", "nonzero"}


class HostSyncCounter(TorchFunctionMode):
    """Counts, by name, the syncing calls whose caller is a megatron_startrail source file."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            caller = sys._getframe(1).f_code.co_filename  # the line that made the call
            if "megatron_startrail" in caller and "/tests/" not in caller:
                self.calls.append(f"{name} at {caller.rsplit('/', 1)[-1]}:{sys._getframe(1).f_lineno}")
        return func(*args, **(kwargs or {}))


def packed_sample(micro_batch: int, cp: int, cp_rank: int):
    """A packed sample (sample layout) of random documents: this rank's tokens and positions,
    and fresh PackedSeqParams, as Megatron builds them for every micro-batch."""
    gen = torch.Generator().manual_seed(100 + micro_batch)
    cuts = sorted(torch.randperm(SEQ - 1, generator=gen)[:3].add(1).tolist())
    cu = torch.tensor([0, *cuts, SEQ], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (SEQ,), generator=gen)
    positions = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
    chunk = SEQ // (2 * cp)
    held = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=int((cu[1:] - cu[:-1]).max()), max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
    return tokens[held][None], positions[held][None], params


def sync_worker(rank, world_size, team_size, mla):
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    torch.manual_seed(0)
    common = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                  context_parallel_size=world_size, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False)
    config = (MLATransformerConfig(**common, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                                   v_head_dim=4, rope_type="rope") if mla else TransformerConfig(**common))
    groups = initialize_startrail(team_size)
    spec = to_startrail_spec(get_gpt_layer_local_spec(multi_latent_attention=mla), groups)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    agreements = []
    start = groups.transport.collective
    groups.transport.collective = lambda fn, *a, group, label, **kw: (
        agreements.append(label) if label == "document_check" else None,
        start(fn, *a, group=group, label=label, **kw))[1]
    per_micro_batch = []
    for micro_batch in range(MICRO_BATCHES):
        tokens, positions, params = packed_sample(micro_batch, world_size, parallel_state.get_context_parallel_rank())
        agreements.clear()
        with HostSyncCounter() as counter:
            loss = model(tokens, positions, None, labels=tokens, packed_seq_params=params)
            loss.float().sum().backward()
        per_micro_batch.append((counter.calls, len(agreements)))
    Utils.destroy_model_parallel()
    return per_micro_batch


@pytest.mark.parametrize("mla", [False, True], ids=["attention", "mla"])
def test_packed_gpt_syncs_once_per_micro_batch_not_per_layer(mla):
    for per_micro_batch in run_ranks(sync_worker, 4, args=(2, mla), timeout=180):
        assert len(per_micro_batch) == MICRO_BATCHES
        for calls, agreements in per_micro_batch:
            assert len(calls) <= 1, calls  # 4 layers: the one sync of the document agreement
            assert agreements == 1  # one agreement collective over the CP group, by the first layer


# -- host-to-device copies, one rank at full size on the meta device ----------------------------

# Torch functions that build a tensor from host data where their ``device`` says.
CONSTRUCTORS = {"tensor", "as_tensor", "asarray", "from_numpy"}


def _off_cpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _host_data(x) -> bool:
    """A CPU tensor with data (not a 0-dim wrapped scalar) or a Python list used as data."""
    if isinstance(x, torch.Tensor):
        return x.device.type == "cpu" and x.dim() > 0
    return isinstance(x, list)


def _where() -> str:
    """The innermost frame outside torch and this file: who asked for the op."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


class _DeviceFunctions(TorchFunctionMode):
    """Host data made into a device tensor at the Python level (invisible to a dispatch mode:
    ``torch.tensor(list, device=...)`` builds on the CPU and copies below the dispatcher), a
    list used as an index of a device tensor, and the host syncs of :data:`SYNCS`."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        device = kwargs.get("device")
        if name in CONSTRUCTORS and device is not None and torch.device(device).type != "cpu":
            self.counter.copies.append(f"torch.{name} at {_where()}")
        elif name in ("__getitem__", "__setitem__", "index_put_") and args and _off_cpu(args[0]) and any(
                _host_data(i) for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.counter.copies.append(f"{name} with a host index at {_where()}")
        elif name in SYNCS and args and _off_cpu(args[0]):
            self.counter.syncs.append(f"{name} at {_where()}")
        return func(*args, **kwargs)


class _DeviceOps(TorchDispatchMode):
    """ATen copies between the CPU and the device: CPU -> device (a copy), device -> CPU and
    ``_local_scalar_dense`` (a sync)."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.counter.syncs.append(f"aten.{name} at {_where()}")
        elif name in ("_to_copy", "copy_", "_copy_from", "copy"):
            src = args[1] if name in ("copy_", "copy") else args[0]
            dst = args[0] if name in ("copy_", "copy") else out
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device != dst.device:
                if src.device.type == "cpu":
                    pinned = " pinned" if src.is_pinned() else ""
                    blocking = " non-blocking" if (kwargs or {}).get("non_blocking") or (
                        name == "copy_" and len(args) > 2 and args[2]) else ""
                    self.counter.copies.append(f"aten.{name}{pinned}{blocking} at {_where()}")
                elif dst.device.type == "cpu":
                    self.counter.syncs.append(f"aten.{name} to the CPU at {_where()}")
        return out


class DeviceCopyCounter:
    """Inside: host -> device copies (``copies``) and host syncs (``syncs``), each with where."""

    def __init__(self):
        self.copies, self.syncs = [], []
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        self._stack.enter_context(_DeviceFunctions(self))
        self._stack.enter_context(_DeviceOps(self))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


@contextlib.contextmanager
def varlen_stand_in():
    """The reference kernel as a fused variable-length GPU kernel looks to the metadata: every
    call reads its ``cu_seqlens`` on the device (as flash-attn's adapter does), and the math is
    skipped (meta tensors have no values): results are empty tensors of the right shapes."""
    from megatron_startrail import kernels  # noqa: PLC0415

    cls = kernels.ReferenceKernel
    saved = cls.forward, cls.backward

    def read(call, q):
        call.tensor("cu_seqlens_q", q.device, q.shape[1])
        call.tensor("cu_seqlens_k", q.device, q.shape[1])

    def forward(self, q, k, v, call, *, scale):
        read(call, q)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape[:3] + v.shape[3:]), q.new_empty((q.shape[1], q.shape[2], q.shape[0]), dtype=acc)

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        read(call, q)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    cls.forward, cls.backward = forward, backward
    try:
        yield
    finally:
        cls.forward, cls.backward = saved


# 32 documents (mean 512 tokens, half a zigzag chunk: most chunks hold several, many documents
# span two): the layouts' cost is per document (64 took 22 s of CPU for the document layout);
# a copy per document or per step would still show as more than one per micro-batch.
META_WORLD, META_TEAM, META_TOKENS, META_LAYERS, META_MICRO_BATCHES, META_DOCS = 8, 2, 16384, 3, 3, 32


def count_copies(layout: str | None, rank: int = 1):
    """Per micro-batch, per layer: (copies, syncs) of rank ``rank`` of P = 8, C = 2 on the meta
    device; ``layout`` None (dense), "sample" (cu_seqlens) or "document" (and cu_seqlens_padded).
    Every micro-batch has new documents and new cu_seqlens tensors, as Megatron makes them."""
    from benchmarks.counters.launch_budget import fake_rank, lognormal_documents  # noqa: PLC0415
    from megatron_startrail import new_startrail_groups, startrail_attn  # noqa: PLC0415
    from megatron_startrail.comm import CommStats  # noqa: PLC0415
    from megatron_startrail.documents import agree_on_documents  # noqa: PLC0415

    n, meta = META_TOKENS // META_WORLD, torch.device("meta")
    per_micro_batch, documents = [], []
    with fake_rank(rank, META_WORLD), varlen_stand_in():
        groups = new_startrail_groups(team_size=META_TEAM, kernel="reference")
        for micro_batch in range(META_MICRO_BATCHES):
            extra = {}
            if layout is not None:
                extra = dict(zip(("cu_seqlens", "cu_seqlens_padded"), lognormal_documents(
                    META_TOKENS, META_DOCS, META_WORLD, layout == "document", seed=micro_batch)))
                # The agreement (the one host sync of a micro-batch, counted by the test above) runs
                # on the CPU here: meta tensors have no values to agree on.
                documents.append(weakref.ref(agree_on_documents(*extra.values(), n, 1, groups, CommStats(),
                                                                torch.device("cpu"))))
            layers = []
            for _ in range(META_LAYERS):
                q, k, v = (torch.empty(n, 1, 4, 16, device=meta, requires_grad=True) for _ in range(3))
                with DeviceCopyCounter() as counter:
                    out = startrail_attn(q, k, v, groups, **extra)
                    torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
                layers.append((counter.copies, counter.syncs))
            per_micro_batch.append(layers)
            del q, k, v, out, extra
    gc.collect()
    return per_micro_batch, [ref() is not None for ref in documents]


@pytest.mark.parametrize("layout", [None, "sample", "document"], ids=["dense", "sample", "document"])
def test_one_copy_per_micro_batch_and_no_sync(layout):
    """P = 8, C = 2, 16K tokens, 32 documents, 3 layers a micro-batch, 3 micro-batches: no host
    sync at all; one non-blocking copy per micro-batch, made by its first layer (none for dense
    after the first micro-batch). The first micro-batch of a run learns which rows the steps
    attend to (Note [device metadata] in megatron_startrail/microbatch.py): a copy per step
    whose calls were missing. Before: 8 (sample) and 28-31 (document) blocking copies per
    micro-batch, 21 in dense's first."""
    from megatron_startrail import microbatch  # noqa: PLC0415

    microbatch._REQUESTS.clear()  # a cold run: what the first micro-batch learns is counted too
    per_micro_batch, documents_alive = count_copies(layout, rank=3)
    for micro_batch, layers in enumerate(per_micro_batch):
        copies = [c for layer_copies, _ in layers for c in layer_copies]
        assert not any(syncs for _, syncs in layers), (micro_batch, layers)
        if micro_batch > 0:
            assert len(copies) <= (0 if layout is None else 1), (micro_batch, copies)
        else:
            assert 1 <= len(copies) <= 6, copies  # per step of the first layer, at most (3 fwd + 3 bwd here)
        assert not any(layer_copies for layer_copies, _ in layers[1:]), (micro_batch, layers)  # shared by the layers
        assert all("non-blocking" in c for c in copies), copies
    assert not any(documents_alive), documents_alive  # the micro-batches' metadata went with them
