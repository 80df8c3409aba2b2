"""Which transport a process group gets from its backend string, mixed strings included
(``dist.get_backend`` of a group created for CPU and CUDA says "cpu:gloo,cuda:nccl"). No
process group and no GPU: the backend string is what is under test."""

import pytest
import torch
import torch.distributed as dist

from megatron_startrail import transport
from megatron_startrail.transport import GlooTransport, NcclTransport, backend_for_device, transport_for


def transport_of(monkeypatch, reported, device_type):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: reported)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    return transport_for({"startrail": object()}, (0, 1), device_type=device_type)


@pytest.mark.parametrize("reported, device_type, expected", [
    ("gloo", "cpu", GlooTransport),
    ("nccl", "cuda", NcclTransport),
    ("cpu:gloo,cuda:nccl", "cuda", NcclTransport),  # the attention's CUDA tensors go through NCCL
    ("cpu:gloo,cuda:nccl", "cpu", GlooTransport),
    ("cuda:nccl,cpu:gloo", "cpu", GlooTransport),  # order does not matter
    ("cpu:fake,meta:fake", "cpu", GlooTransport),  # torch's no-op group stands in for either
])
def test_transport_follows_the_backend_of_the_attention_device(monkeypatch, reported, device_type, expected):
    assert type(transport_of(monkeypatch, reported, device_type)) is expected


def test_the_default_device_is_cuda_when_there_is_a_gpu(monkeypatch):
    monkeypatch.setattr(transport.torch.cuda, "is_available", lambda: True)
    assert type(transport_of(monkeypatch, "cpu:gloo,cuda:nccl", None)) is NcclTransport
    monkeypatch.setattr(transport.torch.cuda, "is_available", lambda: False)
    assert type(transport_of(monkeypatch, "cpu:gloo,cuda:nccl", None)) is GlooTransport


@pytest.mark.parametrize("reported, device_type, words", [
    ("cpu:gloo", "cuda", ["'cpu:gloo'", "none for cuda", "it has: cpu"]),
    ("cuda:nccl", "cpu", ["'cuda:nccl'", "none for cpu"]),
    ("cpu:gloo,cuda:ucc", "cuda", ["'ucc'", "'cpu:gloo,cuda:ucc'", "gloo (CPU) or nccl (GPU)"]),
    ("mpi", "cpu", ["'mpi'"]),
])
def test_no_fitting_backend_is_a_clear_error(monkeypatch, reported, device_type, words):
    with pytest.raises(ValueError) as error:
        transport_of(monkeypatch, reported, device_type)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_backend_for_device_reads_each_pair():
    assert backend_for_device("cpu:gloo, cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("nccl", "cpu") == "nccl"  # one backend: it carries every device


@pytest.mark.parametrize("reported, device_type, expected", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("nccl", "cuda", "nccl"),
    ("cpu:fake,meta:fake", "cuda", "nccl"),
])
def test_group_backend_is_the_one_answer_for_groups_and_megatron_options(monkeypatch, reported, device_type, expected):
    # groups.py (whether the CP twin is built), megatron/parallel_state.py and dynamic_cp.py
    # (NCCL group options) ask group_backend, so a mixed string means the same to all of them.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: reported)
    assert transport.group_backend(device_type=device_type) == expected


def test_the_attention_takes_the_transport_of_its_tensors_device(monkeypatch):
    # torch's fake group (every operation returns at once) stands in for a 4-rank world: the groups
    # carry both devices; which transport posts is decided by the tensors, never by whether this
    # process sees a GPU (a CUDA rehearsal on a CPU build: tests/fake_cuda).
    import dataclasses

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_startrail import new_startrail_groups, startrail_attn

    posts = []
    for cls in (GlooTransport, NcclTransport):
        monkeypatch.setattr(cls, "post", lambda self, *a, _post=cls.post, _cls=cls, **k: posts.append(_cls) or
                            _post(self, *a, **k))
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        groups = new_startrail_groups(team_size=2, eager_init=False)
        (gloo, gloo_cp), (nccl, nccl_cp) = groups.device_transports["cpu"], groups.device_transports["cuda"]
        # (isinstance: the tests' checking mode wraps each class in one that audits NCCL's rules)
        assert all(isinstance(t, GlooTransport) for t in (gloo, gloo_cp))
        assert all(isinstance(t, NcclTransport) for t in (nccl, nccl_cp))
        assert groups.transport is gloo and nccl_cp.p2p_roles == ("cp", "cp_twin")
        q, k, v = (torch.randn(16, 1, 2, 8, requires_grad=True) for _ in range(3))

        def posted_by(g):
            posts.clear()
            startrail_attn(q, k, v, g, causal=True).sum().backward()
            return set(posts)

        assert posted_by(groups) == {GlooTransport}
        # The same CPU tensors, with groups whose CPU transport is NCCL's: NCCL's transport posts.
        assert posted_by(dataclasses.replace(groups, device_transports={"cpu": (nccl, nccl_cp)})) == {NcclTransport}
        with pytest.raises(ValueError, match="got cpu tensors, but its process groups carry only cuda"):
            startrail_attn(q, k, v, dataclasses.replace(groups, device_transports={"cuda": (nccl, nccl_cp)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gloo_says", [
    "[pair.cc:537] Read error [127.0.0.1]:15763: Connection reset by peer",  # the peer's process gone: a failed read
    "[pair.cc:553] Connection closed by peer [127.0.0.1]:53479",  # or end-of-file, by timing
])
def test_gloo_errors_name_the_operation_whether_met_posting_or_waiting(monkeypatch, gloo_says):
    # A peer that is gone surfaces where this rank next touches its connection: in a wait, or
    # already in isend once gloo has seen the connection close (test_compile's failure case met
    # both on a loaded machine). Either way the error names the StarTrail operation.
    gloo = transport_of(monkeypatch, "gloo", "cpu")

    def gloo_raises(*args, **kwargs):
        raise RuntimeError(gloo_says)

    class Work:
        wait = staticmethod(gloo_raises)

    monkeypatch.setattr(dist, "P2POp", lambda *args, **kwargs: args)  # no process group here
    monkeypatch.setattr(dist, "batch_isend_irecv", gloo_raises)
    with pytest.raises(RuntimeError, match=r"^StarTrail init_send failed on this rank, posting a transfer \(a peer "
                       r"that raised or died, or the process group's timeout\): ") as posting:
        gloo.post([(torch.ones(2), 1)], [], channel="side", label="init_send")
    with pytest.raises(RuntimeError, match=r"^StarTrail team_merge failed on this rank, waiting for a peer ") as waiting:
        gloo.wait([Work()], label="team_merge")
    for raised in (posting, waiting):
        assert str(raised.value).endswith(gloo_says) and str(raised.value.__cause__) == gloo_says
