"""The StarTrail flags through Megatron's own, unmodified parser, and their validation errors."""

import re
import types

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron.training)

from megatron.training.arguments import parse_args  # noqa: E402

from megatron_startrail.megatron.arguments import add_startrail_args, validate_startrail_args  # noqa: E402

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "1", "--lr", "1e-3", "--attention-dropout", "0",
]


def parse(monkeypatch, *extra):
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *BASE, *extra])
    return parse_args(extra_args_provider=add_startrail_args)


def test_megatron_parser_accepts_the_flags(monkeypatch):
    args = parse(monkeypatch, "--context-parallel-size", "8", "--context-parallel-algo", "startrail",
                 "--startrail-team-size", "2", "--ulysses-degree-in-cp", "2")
    assert (args.context_parallel_algo, args.startrail_team_size, args.ulysses_degree_in_cp) == ("startrail", 2, 2)
    validate_startrail_args(args)
    assert args.startrail_team_size == 2


def test_defaults_leave_megatron_alone(monkeypatch):
    args = parse(monkeypatch, "--context-parallel-size", "2")
    assert (args.context_parallel_algo, args.startrail_team_size, args.ulysses_degree_in_cp) == ("megatron", "auto", 1)
    validate_startrail_args(args)  # Megatron's own CP: nothing to check, nothing changed
    assert args.startrail_team_size == "auto"


def test_tasp_is_startrail_with_team_size_one_and_multiring(monkeypatch):
    args = parse(monkeypatch, "--context-parallel-size", "8", "--context-parallel-algo", "tasp")
    validate_startrail_args(args)
    assert (args.startrail_team_size, args.startrail_transfer) == (1, "multiring")


def test_auto_team_size_asks_the_planner_with_the_flags_values(monkeypatch):
    """``--startrail-team-size auto`` hands the planner what the flags say, per rank after
    tensor and pipeline parallelism, and applies the plan it returns.

    Each expected input is worked out here from the flags (not by calling the code that
    computes it); the planner is replaced by a spy, so this tests the flags' way in and the
    plan's way out whatever the planner's model predicts."""
    asked = {}

    def spy(**inputs):
        asked.update(inputs)
        return types.SimpleNamespace(team_size=4, regather_in_backward=True, rotation="q",
                                     reverse_overlap=False)  # none is a default

    monkeypatch.setattr("megatron_startrail.planning.planner.choose_plan", spy)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = parse(monkeypatch, "--context-parallel-size", "16", "--context-parallel-algo", "startrail",
                 "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--num-layers", "4", "--group-query-attention", "--num-query-groups", "2", "--bf16",
                 "--micro-batch-size", "2", "--global-batch-size", "2",
                 "--seq-length", "4096", "--max-position-embeddings", "4096")
    validate_startrail_args(args)
    assert asked == dict(
        cp_size=16, ulysses_size=1,
        gpus_per_node=4,  # 8 ranks per node, ordered tp-cp-...: 8 / TP 2 consecutive CP ranks
        seq_length=4096,
        num_heads=4,  # 8 heads / TP 2
        num_kv_heads=1,  # 2 query groups / TP 2
        head_dim=8, v_head_dim=8,  # hidden 64 / 8 heads
        micro_batch_size=2,
        dtype_bytes=2,  # --bf16
        layers=2,  # 4 layers / PP 2: the attention layers of one stage
        memory_limit_bytes=None,
        backward_rotation="auto",  # --startrail-backward-rotation: left to the planner
    )
    assert (args.startrail_team_size, args.startrail_regather_in_backward,
            args.startrail_backward_rotation, args.startrail_reverse_overlap) == (4, True, "q", False)


def test_memory_limit_turns_on_the_streamed_rotation_or_regathering_when_only_that_fits(monkeypatch):
    from megatron_startrail.accounting import AttentionShape  # noqa: PLC0415
    from megatron_startrail.planning.memory_model import activation_peak_bytes  # noqa: PLC0415

    flags = ["--context-parallel-size", "8", "--context-parallel-algo", "startrail", "--startrail-team-size", "2",
             "--seq-length", "4096", "--max-position-embeddings", "4096", "--num-layers", "8"]
    shape = AttentionShape(4096 // 8, 1, 8, 8, 8, 4)

    def peak(team_size, regather, rotation="auto"):  # 8 layers
        return activation_peak_bytes(shape, layers=8, cp_size=8, team_size=team_size, regather_in_backward=regather,
                                     rotation=rotation)

    def settings(args):
        return args.startrail_regather_in_backward, args.startrail_backward_rotation

    # Tried in this order; the streamed rotation lowers the peak, with or without regathering.
    options = [(False, "auto"), (False, "q"), (True, "auto"), (True, "q")]
    assert peak(2, False) > peak(2, False, "q") and peak(2, True) > peak(2, True, "q")
    args = parse(monkeypatch, *flags)
    validate_startrail_args(args)
    assert settings(args) == (False, "auto")
    for limit in sorted({peak(2, *option) for option in options}):
        args = parse(monkeypatch, *flags, "--startrail-memory-limit-gb", str((limit + 16) / 1e9))  # GB rounding
        validate_startrail_args(args)
        assert settings(args) == next(option for option in options if peak(2, *option) <= limit + 16), limit
    # An explicit rotation is kept: with "kv" only regathering can help.
    args = parse(monkeypatch, *flags, "--startrail-backward-rotation", "kv", "--startrail-memory-limit-gb",
                 str((peak(2, True, "kv") + 16) / 1e9))
    validate_startrail_args(args)
    assert settings(args) == (True, "kv")
    args = parse(monkeypatch, *flags, "--startrail-memory-limit-gb",
                 str((min(peak(2, *option) for option in options) - 1000) / 1e9))
    with pytest.raises(ValueError, match="--startrail-memory-limit-gb"):
        validate_startrail_args(args)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = parse(monkeypatch, *flags[:4], "--startrail-memory-limit-gb", str((peak(2, True) + 16) / 1e9),
                 "--seq-length", "4096", "--max-position-embeddings", "4096", "--num-layers", "8")
    validate_startrail_args(args)  # auto: whatever C it picks fits
    assert peak(args.startrail_team_size, *settings(args)) <= peak(2, True) + 16


def test_memory_limit_turns_the_reverse_overlap_off_where_only_that_fits(monkeypatch):
    """CP 4, C 2: sub-rings of one position. Between rotation q's peak with its reverse sends
    overlapped and without (Note [reverse overlap] in initial_send.py), the limit takes the overlap
    off before it regathers; --startrail-no-reverse-overlap sets it by hand, into the groups' config."""
    from megatron_startrail.accounting import AttentionShape  # noqa: PLC0415
    from megatron_startrail.megatron.from_args import config_from_args  # noqa: PLC0415
    from megatron_startrail.planning.memory_model import activation_peak_bytes  # noqa: PLC0415

    flags = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2",
             "--seq-length", "4096", "--max-position-embeddings", "4096", "--num-layers", "8"]
    shape = AttentionShape(4096 // 4, 1, 8, 8, 8, 4)
    overlapped, serial = (activation_peak_bytes(shape, layers=8, cp_size=4, team_size=2, rotation="q",
                                                reverse_overlap=overlap) for overlap in (True, False))
    assert serial < overlapped
    args = parse(monkeypatch, *flags, "--startrail-memory-limit-gb", str((serial + 16) / 1e9))
    validate_startrail_args(args)
    assert (args.startrail_regather_in_backward, args.startrail_backward_rotation,
            args.startrail_reverse_overlap) == (False, "q", False)
    assert config_from_args(args).reverse_overlap is False
    args = parse(monkeypatch, *flags, "--startrail-memory-limit-gb", str((overlapped + 16) / 1e9))
    validate_startrail_args(args)
    assert args.startrail_reverse_overlap is True
    args = parse(monkeypatch, *flags, "--startrail-no-reverse-overlap")
    validate_startrail_args(args)
    assert config_from_args(args).reverse_overlap is False


@pytest.mark.parametrize(
    "flags, message",
    [
        # an algo that needs CP > 1
        (["--context-parallel-size", "1"], "--context-parallel-size > 1"),
        (["--context-parallel-size", "1", "--context-parallel-algo", "tasp"], "--context-parallel-size > 1"),
        # team size not fitting the CP size
        (["--context-parallel-size", "8", "--startrail-team-size", "4"], "--startrail-team-size 4"),
        (["--context-parallel-size", "8", "--startrail-team-size", "2", "--ulysses-degree-in-cp", "4"],
         "--startrail-team-size 2"),
        (["--context-parallel-size", "8", "--context-parallel-algo", "tasp", "--startrail-team-size", "2"],
         "--startrail-team-size 1"),
        # --seq-length not divisible by 2 * CP
        (["--context-parallel-size", "4", "--seq-length", "252", "--max-position-embeddings", "252"],
         "--seq-length 252"),
        # Ulysses degree vs CP size, heads and query groups after tensor parallelism
        (["--context-parallel-size", "8", "--ulysses-degree-in-cp", "3"], "--ulysses-degree-in-cp 3"),
        (["--context-parallel-size", "8", "--tensor-model-parallel-size", "2", "--ulysses-degree-in-cp", "8"],
         "--num-attention-heads 8 / --tensor-model-parallel-size 2"),
        (["--context-parallel-size", "8", "--ulysses-degree-in-cp", "2", "--group-query-attention",
          "--num-query-groups", "3", "--num-attention-heads", "6", "--hidden-size", "48"], "--num-query-groups 3"),
        (["--context-parallel-size", "2", "--context-parallel-algo", "megatron", "--ulysses-degree-in-cp", "2"],
         "--ulysses-degree-in-cp"),
        # what the StarTrail core attention cannot do
        (["--context-parallel-size", "4", "--attention-dropout", "0.1"], "--attention-dropout 0"),
        (["--context-parallel-size", "4", "--reset-attention-mask"], "--dataloader-inter-document-masking"),
        # MLA's fused RoPE (on by default) in the whole-sample zigzag of packed pretraining
        (["--context-parallel-size", "4", "--multi-latent-attention", "--dataloader-inter-document-masking"],
         "add --no-rope-fusion"),
        (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
         "--ulysses-degree-in-cp U instead"),
    ],
)
def test_validation_errors_name_the_flag(monkeypatch, flags, message):
    algo = [] if "--context-parallel-algo" in flags else ["--context-parallel-algo", "startrail"]
    args = parse(monkeypatch, *algo, *flags)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_startrail_args(args)


# Every megatron-core 0.19.2 option that changes the attention's mask or softmax and that
# StarTrail does not implement (megatron_startrail/megatron/attention_options.py).
UNSUPPORTED_ATTENTION_FLAGS = [
    (["--apply-query-key-layer-scaling"], "--apply-query-key-layer-scaling"),
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1"),
    (["--experimental-attention-variant", "dsa"], "--experimental-attention-variant dsa"),
    # GPU options that would be accepted and then ignored or broken (GPU hot-path issue)
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    (["--cuda-graph-impl", "transformer_engine"], "--cuda-graph-impl transformer_engine"),
    (["--cuda-graph-impl", "full_iteration"], "--cuda-graph-impl full_iteration"),
    (["--enable-cuda-graph"], "--enable-cuda-graph"),
    # Megatron's own CP communication (accepted and ignored before): StarTrail's all-to-all is Ulysses
    (["--cp-comm-type", "a2a"], "--cp-comm-type a2a"),
    (["--cp-comm-type", "allgather"], "--cp-comm-type allgather"),
    (["--cp-comm-type", "p2p", "a2a"], "--cp-comm-type p2p,a2a"),  # one per layer
]


@pytest.mark.parametrize("algo", ["startrail", "tasp"])
@pytest.mark.parametrize("flags, message", UNSUPPORTED_ATTENTION_FLAGS)
def test_attention_options_startrail_does_not_implement_are_refused(monkeypatch, algo, flags, message):
    """Never a different attention than asked for: each option is refused with its flag."""
    args = parse(monkeypatch, "--context-parallel-size", "4", "--context-parallel-algo", algo, *flags)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        validate_startrail_args(args)
    assert f"--context-parallel-algo {algo}" in str(error.value)


def test_attention_options_startrail_implements_are_accepted(monkeypatch):
    """Sliding windows (StarTrail applies them, tests/test_window.py), vanilla softmax and
    attention sinks (tests/test_sinks.py), QK-clip and the max-logit log (the core attention
    reports current_max_attn_logits: tests/megatron/test_qk_clip.py);
    Megatron's own CP is not checked at all."""
    for flags in (["--window-size=-1,0"], ["--window-size", "32,0"], ["--window-size", "8,8"],
                  ["--window-size", "32,0", "--window-attn-skip-freq", "2"], ["--softmax-type", "vanilla"],
                  ["--softmax-type", "off-by-one"], ["--softmax-type", "learnable"], ["--qk-clip"],
                  ["--log-max-attention-logit"], ["--qk-clip", "--qk-clip-threshold", "5"]):
        validate_startrail_args(parse(monkeypatch, "--context-parallel-size", "4", "--context-parallel-algo",
                                      "startrail", "--startrail-team-size", "2", *flags))
    validate_startrail_args(parse(monkeypatch, "--context-parallel-size", "4", "--window-size", "32,0"))


def test_cp_comm_type_names_ulysses_for_the_all_to_all_and_its_default_is_accepted(monkeypatch):
    args = parse(monkeypatch, "--context-parallel-size", "4", "--context-parallel-algo", "startrail",
                 "--cp-comm-type", "a2a")
    with pytest.raises(ValueError, match=r"--cp-comm-type a2a: .*--ulysses-degree-in-cp U for the all-to-all part"):
        validate_startrail_args(args)
    for flags in ([], ["--cp-comm-type", "p2p"], ["--cp-comm-type", "p2p", "p2p"]):  # Megatron's default, any form
        validate_startrail_args(parse(monkeypatch, "--context-parallel-size", "4", "--context-parallel-algo",
                                      "startrail", "--startrail-team-size", "2", *flags))
    # Megatron's own CP keeps every --cp-comm-type
    validate_startrail_args(parse(monkeypatch, "--context-parallel-size", "4", "--cp-comm-type", "a2a"))


def test_mla_with_packed_documents_is_accepted(monkeypatch):
    """Both packed layouts with --multi-latent-attention (tests/megatron/test_gpt_packed_mla.py
    trains them); only the fused MLA RoPE in the sample layout is refused (above)."""
    for flags in (["--dataloader-inter-document-masking", "--no-rope-fusion"], ["--sft"], ["--sft", "--no-rope-fusion"]):
        validate_startrail_args(parse(monkeypatch, "--context-parallel-size", "4", "--context-parallel-algo",
                                      "startrail", "--startrail-team-size", "2", "--multi-latent-attention", *flags))


def test_bad_flag_values_are_rejected_by_the_parser(monkeypatch):
    for flags in (["--startrail-team-size", "two"], ["--startrail-team-size", "0"],
                  ["--context-parallel-algo", "ring"]):
        with pytest.raises(SystemExit):
            parse(monkeypatch, *flags)


@pytest.mark.parametrize("attribute, value, alternative", [
    ("cuda_graph_impl", "local", "torch.compile the model"),
    ("cuda_graph_impl", "transformer_engine", "torch.compile the model"),
    ("enable_cuda_graph", True, "torch.compile the model"),
    ("external_cuda_graph", True, "torch.compile the model"),
    ("fp8_dot_product_attention", True, "keep FP8 where it pays, in the linear layers (--fp8-format"),
    ("fp8_multi_head_attention", True, "keep FP8 in the linear layers (--fp8-format"),
])
def test_refusals_name_what_to_do_instead(attribute, value, alternative):
    """What stays refused (CUDA graphs, FP8 attention) says why and what to use instead
    (docs/composition.md, 'What stays refused')."""
    from types import SimpleNamespace  # noqa: PLC0415

    from megatron_startrail.megatron.attention_options import check_attention_options  # noqa: PLC0415

    with pytest.raises(ValueError) as refused:
        check_attention_options(SimpleNamespace(**{attribute: value}))
    message = str(refused.value)
    assert alternative in message, message
    assert ("replays fixed launches" in message) if "cuda_graph" in attribute else ("no FP8 attention kernel" in message)


def test_qk_clip_and_the_max_logit_log_need_no_transformer_engine_with_startrail_attention(monkeypatch):
    """Megatron asks for TE >= 2.9 for --qk-clip / --log-max-attention-logit (only TE's attention
    reports max logits); StarTrail's core attention reports them, so validate_megatron_args hides
    those two flags from Megatron's validate_args (here a recorder of what it is handed: its
    CPU run needs the example's setup) for StarTrail attention only (CP4, or CP = 1 with
    StarTrail's spec), restores them, and makes Megatron's other checks of them itself. (The
    values themselves: tests/megatron/test_qk_clip.py, CP4 C2 against CP = 1;
    the logged values through the example: the model fuzzer's max-logit draws.)"""
    from megatron.training import arguments as megatron_arguments  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_megatron_args  # noqa: PLC0415

    seen = []
    monkeypatch.setattr(megatron_arguments, "validate_args",
                        lambda args, defaults: seen.append((args.qk_clip, args.log_max_attention_logit)))
    startrail = ("--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2")
    for flags in (["--qk-clip"], ["--log-max-attention-logit"], ["--qk-clip", "--log-max-attention-logit"]):
        args = parse(monkeypatch, *startrail, *flags)
        validate_megatron_args(args)
        asked = ("--qk-clip" in flags, "--log-max-attention-logit" in flags)
        assert seen.pop() == (False, False) and (args.qk_clip, args.log_max_attention_logit) == asked
        validate_startrail_args(args)
    validate_megatron_args(parse(monkeypatch, "--qk-clip"), startrail_attention=True)  # the CP = 1 reference
    assert seen.pop() == (False, False)
    validate_megatron_args(parse(monkeypatch, "--qk-clip"))  # Megatron's own attention: Megatron's check
    assert seen.pop() == (True, False)
    for flags, message in ((["--qk-clip-alpha", "1.5"], "--qk-clip-alpha 1.5 must be between"),
                           (["--qk-clip-threshold", "0"], "--qk-clip-threshold 0.0 must be greater than 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            validate_megatron_args(parse(monkeypatch, *startrail, "--qk-clip", *flags))


def test_torch_fsdp2_with_per_token_loss_is_refused_by_name(monkeypatch):
    """megatron-core 0.19.2's FSDP2 wrapper ignores --calculate-per-token-loss (its scale_gradients
    is the base class's no-op; FSDP2 averages over DP x CP): every first-step gradient comes out
    (loss tokens / DP x CP) times DDP's, at CP = 1 too (512x at DP1, 256x at DP2, 2 x 256 tokens).
    Refused before Megatron's validate_args (here a recorder), whatever the CP algorithm; each
    flag alone passes."""
    from megatron.training import arguments as megatron_arguments  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_megatron_args  # noqa: PLC0415

    seen = []
    monkeypatch.setattr(megatron_arguments, "validate_args", lambda args, defaults: seen.append(True))
    fsdp2 = ("--use-torch-fsdp2", "--untie-embeddings-and-output-weights")
    for cp in ((), ("--context-parallel-size", "2", "--context-parallel-algo", "startrail")):
        with pytest.raises(ValueError, match="--use-torch-fsdp2 with --calculate-per-token-loss"):
            validate_megatron_args(parse(monkeypatch, *fsdp2, "--calculate-per-token-loss", *cp))
    assert not seen
    validate_megatron_args(parse(monkeypatch, *fsdp2))
    validate_megatron_args(parse(monkeypatch, "--calculate-per-token-loss"))
    assert len(seen) == 2
