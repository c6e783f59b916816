"""Structured-config schemas for every config group, registered in Hydra's ConfigStore.

The YAML presets in ``conf/<group>/*.yaml`` are merged onto these dataclasses, so a wrong type on the command line
(``parallel.tp=abc``) is refused by OmegaConf with the full key before anything runs. Cross-field constraints live in
:mod:`xpar.config.validate`, the one place that turns a composed config into a :class:`xpar.config.spec.RunSpec`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from xpar.config.profile import FrameworkConfig


@dataclass
class ModelConfig:
    """Shape of a decoder-only transformer (Llama or GPT style)."""

    name: str = "tiny"
    """The presets name (model=<name>), shown in run names."""
    n_layers: int = 4
    """Number of transformer blocks (l)."""
    hidden: int = 64
    """Model width (h)."""
    n_heads: int = 4
    """Attention heads (a); head dim = model.head_dim, else hidden / n_heads."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; None means n_heads (multi-head)."""
    ffn_hidden: int = 172
    """MLP inner width (4h for GPT, ~8h/3 rounded for SwiGLU)."""
    vocab_size: int = 256
    """Vocabulary size (V)."""
    seq_len: int = 64
    """Context length the model was published with (s); train.seq_len may shorten it."""
    activation: str = "swiglu"
    """'swiglu' (3 MLP matrices) or 'gelu', 'relu' (OPT), 'squared_relu' (Nemotron-4: relu(x)^2) (2 MLP
    matrices; the three non-gated ones are priced alike: same matmuls, the same activations kept)."""
    norm: str = "rmsnorm"
    """'rmsnorm' or 'layernorm'."""
    position: str = "rope"
    """'rope', 'learned' (absolute position embedding of seq_len rows) or 'alibi' (Press et al. 2022: a per-head
    linear bias on the attention scores, no parameters: BLOOM, MPT; estimated, not executed)."""
    tied_embeddings: bool = False
    """Output projection shares the token-embedding matrix."""
    bias: bool = False
    """Linear layers and norms carry biases (GPT-2/3 do, Llama does not)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Su et al. 2021; Llama 3 uses 500000)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    n_experts: int = 0
    """Routed experts per mixture-of-experts layer (E); 0: a dense model (Shazeer et al. 2017, Fedus et al. 2022)."""
    moe_top_k: int = 2
    """Routed experts each token goes to (k): Mixtral 2, DeepSeek-V3 8."""
    n_shared_experts: int = 0
    """Experts every token goes to beside the routed ones (DeepSeek-V3: 1)."""
    expert_ffn_hidden: Optional[int] = None
    """Inner width of one expert's MLP (same activation as the dense MLP); None: ffn_hidden."""
    first_dense_layers: int = 0
    """Leading blocks with the dense MLP (ffn_hidden) instead of experts (DeepSeek-V3: 3)."""
    moe_layer_freq: int = 1
    """After ``first_dense_layers``, every f-th block holds experts (blocks f-1, 2f-1, ...), the others the dense MLP:
    Llama 4 Maverick 2 (transformers ``Llama4TextConfig`` ``interleave_moe_layer_step``; Megatron-Core's
    ``--moe-layer-freq`` [0, 1] x 24); 1: every block."""
    capacity_factor: Optional[float] = None
    """Tokens an expert takes over its even share k T / E, the rest dropped (Fedus et al. 2022); None: dropless."""
    moe_imbalance: float = 1.0
    """Tokens the busiest ep rank receives over the mean (1: balanced); stretches its experts and all-to-alls."""
    block: str = "sequential"
    """How attention and MLP compose in a block: 'sequential' (x + attn, then + mlp: GPT-2/3, Llama);
    'parallel' (x + attn(ln(x)) + mlp(ln(x)), one norm: GPT-J, PaLM Sec. 2 "Parallel Layers", Falcon-7B);
    'parallel_two_norms' (the same with two norms of x: GPT-NeoX-20B, Falcon-40B/180B). Same matmuls; tensor
    parallelism reduces the summed output once (xpar.config.block). Estimated, not executed."""
    head_dim: Optional[int] = None
    """Width of one attention head (d); null: hidden / n_heads (gpt-oss: 64 heads of 64 in a 2880-wide model):
    q, k, v project to heads x head_dim and wo back to hidden (HF ``head_dim``, Megatron-Core ``kv_channels``)."""
    qk_norm: bool = False
    """Qwen3's q/k RMSNorm; estimate only: inputs counted in a kept eager graph (activations.eager_attention_extra_bytes)."""
    q_lora_rank: Optional[int] = None
    """MLA (multi-head latent attention, DeepSeek-V2/V3): rank of the queries' low-rank projection
    (h -> q_lora_rank -> heads); null: queries projected directly. Read only with kv_lora_rank set."""
    kv_lora_rank: Optional[int] = None
    """MLA: rank of the shared key/value latent (DeepSeek-V3: 512); null: not MLA (MHA/GQA). Estimated
    only: its FLOPs (xpar.config.attention); parameters and activations are still counted as MHA."""
    qk_nope_head_dim: Optional[int] = None
    """MLA: each head's query/key width without position (DeepSeek-V3: 128)."""
    qk_rope_head_dim: Optional[int] = None
    """MLA: each head's rotary query/key width, the rotary key shared by the heads (DeepSeek-V3: 64)."""
    v_head_dim: Optional[int] = None
    """MLA: each head's value width (DeepSeek-V3: 128)."""
    sliding_window: int = 0
    """Sliding-window (local) attention: the keys a query of a local layer sees, itself and the ``sliding_window -
    1`` tokens before it (HF ``sliding_window``: gpt-oss 128, Mistral 7B v0.1 4096, Gemma 2 4096, Gemma 3 1024;
    FlashAttention's ``window_size=(w - 1, 0)``; Megatron-Core ``window_size`` (left, 0) counts left + 1 keys);
    0: every layer attends to the whole causal prefix. Which layers are local: ``sliding_window_pattern``."""
    sliding_window_pattern: int = 0
    """With ``sliding_window``: every k-th layer is full (global) attention, the others local: layer i
    (from 0) is full where (i + 1) % k == 0 (HF Gemma 3 ``sliding_window_pattern`` 6, i.e. 5 local : 1 global;
    gpt-oss and Gemma 2: 2, local first, as their ``layer_types``; Megatron-Core ``window_attn_skip_freq``);
    0: every layer local (Mistral 7B v0.1)."""
    attention_sinks: bool = False
    """Learned attention sinks: one logit per head added to every softmax denominator (gpt-oss ``sinks``, OpenAI's
    gpt_oss/torch/model.py; Megatron-Core ``softmax_type='learnable'``); priced as the framework's kernel runs them
    (framework.sink_attention), not executed."""
    moe_routing: str = "learned"
    """'learned' (top-k of router scores) or 'round_robin': token t to experts (t k + j) mod E, j < k, the benchmark
    gates of AutoModel and torchtitan (xpar.estimate.expert_parallel.round_robin_reach); estimate only."""
    mtp_layers: int = 0
    """Multi-token prediction depth (``--mtp-num-layers``), on the last stage: xpar.estimate.columns.mtp. Estimated."""
    moe_router_groups: int = 0
    """Group-limited routing: the experts split into this many equal groups (DeepSeek-V3 ``n_group`` 8: one group
    per node of its ep 64; Megatron-Core ``--moe-router-num-groups``); 0: every expert open to every token."""
    moe_router_group_topk: int = 0
    """Group-limited routing: groups a token's experts are chosen from, those with the highest top-(k / M) router
    scores (DeepSeek-V3 ``topk_group`` 4, "each token is sent to at most 4 nodes", Sec. 2.1.2; Megatron-Core
    ``--moe-router-group-topk``); with DeepEP, fewer nodes a token crosses to (xpar.estimate.expert_parallel)."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def moe_layers(self) -> int:
        """Blocks with experts: one in moe_layer_freq after the first_dense_layers (0 for a dense model)."""
        return max(0, self.n_layers - self.first_dense_layers) // max(1, self.moe_layer_freq) if self.n_experts else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global block ``layer`` holds experts (:attr:`moe_layer_freq`, :attr:`first_dense_layers`)."""
        f, after = max(1, self.moe_layer_freq), layer - self.first_dense_layers
        return self.n_experts > 0 and after >= 0 and after % f == f - 1

    def is_local_layer(self, layer: int) -> bool:
        """Whether global block ``layer`` attends within ``sliding_window`` (``sliding_window_pattern``)."""
        k = self.sliding_window_pattern
        return self.sliding_window > 0 and (k == 0 or (layer + 1) % k != 0)

    @property
    def local_layers(self) -> int:
        """Blocks with sliding-window attention: n_layers - n_layers // k for a pattern k, all of them for
        k = 0, none without a window (gpt-oss-120b: 18 of 36; Gemma 3 27B: 52 of 62)."""
        k = self.sliding_window_pattern
        return 0 if self.sliding_window <= 0 else self.n_layers - (self.n_layers // k if k else 0)

    @property
    def expert_ffn(self) -> int:
        """One expert's MLP inner width."""
        return self.ffn_hidden if self.expert_ffn_hidden is None else self.expert_ffn_hidden

    @property
    def head_size(self) -> int:
        """Width of one attention head: ``head_dim``, else hidden / n_heads (a validated RunSpec's model
        has ``head_dim`` resolved to it: xpar.config.validate.build_spec)."""
        return self.head_dim or self.hidden // max(1, self.n_heads)

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries and context, n_heads x head_size (hidden unless head_dim is set)."""
        return self.n_heads * self.head_size


@dataclass
class ParallelConfig:
    """The parallel layout: degrees, ZeRO stage, micro-batching, pipeline schedule."""

    name: str = "dp"
    """The presets name (parallel=<name>), shown in run names."""
    dp: Any = "auto"
    """Data-parallel degree, or 'auto' = world size / (tp * pp)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row splits within a layer)."""
    pp: int = 1
    """Pipeline-parallel degree (stages across layers)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks in 2 cp load-balanced chunks, K and V
    all-gathered per layer (Llama 3 paper Sec. 3.3.2); world = dp x cp x tp x pp. Executed (xpar.parallel.context)."""
    ep: int = 1
    """Expert-parallel degree: E experts split over ep ranks inside dp x cp (adds no ranks; Megatron-Core,
    torchtitan), tokens sent by all-to-all; executed with ZeRO 0-3, pp and tp (xpar.parallel.expert)."""
    etp: Optional[int] = None
    """Expert tensor-parallel degree (Megatron-Core's --expert-tensor-parallel-size; None: tp); etp < tp
    folds tp ranks into ep (MoE parallel folding): ep x etp divides tp x cp x dp. Estimated only."""
    zero_stage: int = 0
    """0: DDP; 1: ZeroRedundancyOptimizer over DDP; 2/3: FSDP2 reshard_after_forward=False/True."""
    zero_shard_size: Optional[int] = None
    """Hierarchical ZeRO (torch FSDP2's HSDP, DeepSpeed ZeRO++ hpZ): ZeRO-2/3 shard inside groups of
    this many consecutive dp ranks and replicate across the dp / zero_shard_size groups (gradients
    reduce-scattered in the group, then all-reduced across the replicas); null: shard over all of dp."""
    micro_batches: Any = "auto"
    """Micro-batches per step per dp rank (m), accumulated or pipelined; 'auto': global batch / (b * dp)."""
    pipeline_micro_batches: Optional[int] = None
    """Micro-batches per pipeline schedule run, k | m: m / k runs a step, a bubble each (NeMo AutoModel: a run per
    accumulation step, xpar.config.checks.layout.check_pipeline_runs); null: one run. Estimate only."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, zero_bubble, zbv, dualpipev; and
    zb_h1, zb_h2 (Qi et al. 2024, one stage per rank): estimate-only, refused in execute mode."""
    virtual_stages: Any = 1
    """Stages per pipeline rank (v) for interleaved and V-shaped schedules, or 'auto': 1 for
    gpipe and 1f1b, 2 for the others."""
    layer_split: Optional[list] = None
    """Explicit layers per pipeline stage, e.g. [3, 5]; None splits evenly. The first and the last
    stage may hold 0 (the embedding alone, the output head alone), the others >= 1."""
    first_stage_layers: Optional[int] = None
    """Blocks on the first pipeline stage, the rest split evenly over the others (Megatron-LM's
    --decoder-first-pipeline-num-layers); 0: the embedding alone. None: no rule. Not with layer_split."""
    last_stage_layers: Optional[int] = None
    """Blocks on the last pipeline stage (Megatron-LM's --decoder-last-pipeline-num-layers); 0: the
    final norm, output projection and loss alone. None: no rule. Not with layer_split."""
    sequence_parallel: bool = False
    """Shard norm/dropout regions along the sequence on the tp axis (Korthikanti et al. 2022)."""
    recompute: str = "none"
    """Rematerialisation policy per block (xpar.config.remat, run by xpar.parallel.recompute): none | full
    | selective (framework.selective_recompute) | attention (Megatron's) | op (xpar's) | torchtitan_op |
    save_dot_except_mlp | save_qkv_proj (MaxText's) | moe (Megatron-Core's MoE recompute); attention,
    torchtitan_op and moe are estimated, not executed."""
    recompute_layers: Optional[int] = None
    """Blocks per stage (model chunk) the policy applies to, the first ones (Megatron-LM's
    --recompute-num-layers, --recompute-method block); a smaller stage recomputes all of its. null:
    every block (times framework.recompute_layer_fraction)."""
    activation_offload_layers: Optional[int] = None
    """First N blocks' activations to host (Megatron's --cpu-offloading-num-layers; memory.activation_offload); 0: none."""
    reference_hardware: Optional[str] = None
    """Hardware preset this layout was written for (cluster presets)."""


@dataclass
class HardwareConfig:
    """A machine or cluster. 'local' is detected at run time."""

    name: str = "local"
    """The presets name (hardware=<name>); local: this machine, measured."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda if available, else cpu)."""
    gpu: Optional[str] = None
    """Accelerator model, e.g. 'A100-SXM4-80GB'."""
    devices_per_node: Any = "auto"
    """GPUs per node, or CPU workers for local runs; 'auto' detects."""
    nodes: int = 1
    """Nodes of devices_per_node devices each (world size = nodes x devices_per_node)."""
    device_memory_gb: Optional[float] = None
    """Memory per device in GB (1e9 bytes), as the device reports it; None detects (host RAM on CPU),
    on hardware=local only: elsewhere refused (xpar.config.checks.hardware)."""
    peak_tflops: Optional[float] = None
    """Dense peak per device for bf16/fp16 (tensor cores on GPUs) in TFLOP/s (1e12 FLOP/s); None
    measures, on hardware=local with a CPU only: refused on other hardware and for an estimate of a
    local GPU (xpar.config.checks.hardware). MFU is measured against it."""
    peak_tflops_fp8: Optional[float] = None
    """Dense FP8 peak per device in TFLOP/s, what train.dtype=fp8 matmuls run at (H100/H200 SXM:
    1979, NVIDIA datasheet); None: the device has no FP8 matmuls (A100, a CPU): fp8 is refused."""
    fp8_matmul_efficiency: float = 1.0
    """Of FP8 matmuls, the fraction of the bf16 matmul efficiency (xpar.estimate.cost.matmul_efficiency)
    they reach at their own peak, casts included; 1.0 where unknown (the H100 presets: 0.78, fitted on
    published FP8 runs, tests/data/cp_fp8_h100.csv)."""
    peak_tflops_fp32: Optional[float] = None
    """Dense fp32 peak per device in TFLOP/s, what train.dtype=fp32 matmuls run at (torch's default
    fp32 matmul precision 'highest': no TF32 tensor cores); None: peak_tflops (a CPU measures fp32)."""
    hbm_tb_per_s: Optional[float] = None
    """Device memory bandwidth in TB/s (1e12 bytes/s); None measures on hardware=local."""
    sm_count: Optional[int] = None
    """SMs per device (A100 108, H100/H200 SXM 132, B200 148): GEMM tiles run over them in waves; None: a CPU."""
    gemm_tile_m: int = 128
    """Rows of a GEMM's CTA tile in the library's large-GEMM kernels (CUTLASS/cuBLAS: 128), a multiple of 16."""
    gemm_tile_n: int = 256
    """Columns of that tile (CUTLASS 3 Hopper/Blackwell: 256 per SM), a multiple of 16."""
    gemm_efficiency: Optional[float] = None
    """A large BF16 GEMM's main-loop fraction of peak_tflops, (0, 1] (MAMF; Blackwell: TE's GEMM bench); None: none."""
    gemm_efficiency_fp8: Optional[float] = None
    """The same for FP8 GEMMs, of peak_tflops_fp8, in (0, 1] (per device: H100 0.71, B200 0.64)."""
    attention_efficiency: Optional[float] = None
    """The device's fastest flash attention's forward fraction of the BF16 peak at 16k keys, head_dim 128, in (0, 1]
    (FlashAttention-2 on A100, -3 on H100: framework.attention_kernel fa3 or cudnn); BF16 under FP8 recipes too."""
    attention_bwd_efficiency: Optional[float] = None
    """The same for its backward pass, in (0, 1]."""
    attention_efficiency_fa2: Optional[float] = None
    """FlashAttention-2's forward fraction (attention_kernel fa2, sdpa), (0, 1]; None: attention_efficiency (A100)."""
    attention_bwd_efficiency_fa2: Optional[float] = None
    """The same for its backward pass, in (0, 1]; None: ``attention_bwd_efficiency``."""
    attention_efficiency_cudnn_2024: Optional[float] = None
    """cuDNN's fused attention of 2024 (9.0-9.4; framework.attention_kernel cudnn_2024), forward, as the fa2 fields."""
    attention_bwd_efficiency_cudnn_2024: Optional[float] = None
    """Its backward pass; None: ``attention_bwd_efficiency``."""
    attention_half_seq: float = 360.0
    """Keys at which flash attention runs at half its asymptote, > 0 (kernels.ATTENTION_HALF_SEQ: H100 360, B200 1300)."""
    gemm_tile_fixed_us_fp8: float = 0.0
    """Microseconds an FP8 GEMM tile spends beside its main loop, >= 0 (xpar.estimate.compute.kernels.FP8_TILE_FIXED_S)."""
    kernel_launch_us: float = 0.0
    """Microseconds one kernel launched back to back adds to the device (launch, ramp, tail): kernels.kernel_overhead."""
    mxfp8: bool = False
    """The tensor cores take MXFP8 (an E8M0 scale per 32 FP8 elements) and FP8 operands in every layout (Blackwell:
    Transformer Engine's MXFP8 recipe page lists SM 10.0 and 10.3); train.fp8_recipe=mxfp8 needs it."""
    sustained_efficiency: float = 1.0
    """Fraction of the kernel model's isolated-kernel rates (gemm_efficiency, attention_efficiency) a training step
    sustains, in (0, 1]: clocks under a step's power draw, SMs lent to overlapped communication. The one constant
    fitted per GPU family on published runs (xpar.estimate.compute.kernel_costs; docs/accuracy/published.md)."""
    intra_node_gb_per_s: Optional[float] = None
    """Per-device intra-node link bandwidth (NVLink), GB/s per direction."""
    inter_node_gb_per_s: Optional[float] = None
    """Bandwidth of one inter-node NIC (InfiniBand/RoCE), GB/s per direction; None: one node only
    (refused with nodes > 1: cross-node traffic would be priced at the intra-node link's speed)."""
    nics_per_node: Optional[int] = None
    """Inter-node NICs per node (compute fabric), an integer >= 1; None: one per device."""
    collective_latency_us: float = 8.4
    """Fixed start-up latency of one collective, microseconds (alpha_base; NCCL src/graph/tuning.cc baseLat, ring,
    Simple protocol). Every ``*_us`` field is >= 0 (xpar.config.checks.hardware): it adds to the step."""
    intra_node_latency_us: float = 3.4
    """Latency of one ring step over the intra-node link, microseconds (NCCL tuning.cc hwLat NVLink, ring, Simple)."""
    inter_node_latency_us: float = 9.6
    """Latency of one ring step across nodes, microseconds (NCCL tuning.cc hwLat NET, ring, Simple)."""
    p2p_latency_us: Optional[float] = None
    """Latency of one point-to-point message (a pipeline send), microseconds, where it is
    measured on its own (``xpar calibrate``: gloo's send/recv costs ~50 us here while its
    collectives pay ~0.3-4 ms per step); None: collective_latency_us + one link step."""
    ring_step_us_by_bytes: Optional[dict] = None
    """Measured seconds of one ring step by collective and chunk size, inside one node: for each of 'allreduce',
    'allgather', 'reduce_scatter', 'send_recv' a list of [chunk bytes, microseconds per step] (``xpar calibrate``:
    payload / ranks per step, time / ring steps; send_recv: the message, one step). Where a collective has its curve, a
    single-node group pays ring steps x the curve at its chunk (xpar.estimate.comm.collectives.measured_time) instead of
    the alpha-beta model: gloo's cost per byte differs by collective and grows faster than linear past a few MiB. None:
    the alpha-beta model (GPU presets)."""
    matmul_efficiency: float = 0.7
    """Achievable fraction of peak for large matmuls (cost model calibration)."""
    link_efficiency: float = 0.8
    """Achievable fraction of link bandwidth for collectives (cost model calibration)."""
    deepep_nvl_gb_per_s: Optional[float] = None
    """DeepEP's intranode GB/s a rank (xpar.estimate.expert_parallel.deepep_nvl_rate); None: NCCL's rate."""
    framework_overhead_gb: float = 2.0
    """Fixed per-device memory overhead (CUDA context, allocator, workspace)."""
    memory_headroom: float = 0.0
    """Fraction of device memory the fit check keeps free (0.05: refuse a layout whose
    estimated peak exceeds 95 % of device memory); 0 refuses only what does not fit."""
    op_overhead_us: float = 0.0
    """Host microseconds per aten operator issued, autograd included, where the host's time adds
    to the step (a CPU); measured by ``xpar calibrate``; 0: hidden (GPU presets). xpar.estimate.compute.host."""
    dtensor_op_overhead_us: float = 0.0
    """Extra host microseconds of an operator on DTensors (FSDP2, tp); measured by ``xpar calibrate``."""
    fsdp_unit_overhead_us: float = 0.0
    """Host us of FSDP2's hooks per unit and micro-batch (forward and backward); measured by ``xpar calibrate``."""
    tp_block_overhead_us: float = 0.0
    """Extra host microseconds of one transformer block under tensor parallelism (DTensor dispatch
    and sharding propagation of the Megatron plan, xpar.parallel.tensor.block_plan), forward and
    backward per micro-batch, measured by ``xpar calibrate`` on a 1-rank mesh (no communication);
    0: estimated from ``dtensor_op_overhead_us`` per linear. xpar.estimate.compute.host."""
    tp_first_overhead_us: float = 0.0
    """The same for the first stage's vocabulary-parallel embedding; measured by ``xpar calibrate``."""
    tp_last_overhead_us: float = 0.0
    """The same for the last stage's norm, output projection and vocabulary-parallel loss
    (``loss_parallel``); measured by ``xpar calibrate``."""
    sync_wait_us: float = 0.0
    """Mean microseconds a blocking collective or pipeline send waits beyond its own time when the ranks arrive from
    compute (the later peer, a woken gloo thread on a busy core), measured by ``xpar calibrate``; added to every
    collective and send (xpar.estimate.comm.collectives). 0: GPU presets (no such measurement)."""
    optimizer_ns_per_element: Optional[float] = None
    """Nanoseconds of torch's single-tensor AdamW step (``foreach=False``, what xpar executes) per parameter element,
    measured by ``xpar calibrate`` (2.0-2.8 ns here, where 84 bytes per element over the measured copy bandwidth would
    say ~4.3: temporaries partly cached); None: bytes over ``hbm_tb_per_s`` (xpar.estimate.cost.optimizer_time)."""
    cpu_cores: Optional[int] = None
    """Cores the local CPU workers share (written by ``xpar calibrate``): more worker threads than
    cores stretch the estimated step (xpar.estimate.compute.host.oversubscription); None: not a shared CPU."""
    pcie_gb_per_s: Optional[float] = None
    """Host <-> device bandwidth per device, GB/s per direction, with every device of the node
    copying at once (optimizer offload, xpar.estimate.memory.offload); None: unknown (no offload)."""
    host_memory_gb: Optional[float] = None
    """Host memory (DRAM) per node, GB (1e9 bytes): holds offloaded optimizer states; None: unknown."""
    host_mem_gb_per_s: Optional[float] = None
    """Host memory bandwidth per node, GB/s (all sockets): bounds the host AdamW step of an
    offloaded optimizer; None: unknown (no offload)."""
    sharp: bool = False
    """In-network reduction (NVLink SHARP inside a node, InfiniBand SHARP across nodes; NCCL's NVLS and
    CollNet algorithms): an all-reduce sends each rank's data to the switch once and reads the result once
    (bus bytes 1x the buffer, not the ring's 2 (n - 1) / n), all-reduces and reduce-scatters in one hop
    each way (xpar.estimate.comm.collectives.sharp_time); NCCL takes it where faster. False: rings and trees."""


@dataclass
class TrainConfig:
    """The step loop."""

    steps: int = 10
    """Optimizer steps to run (must be > 0)."""
    warmup_steps: int = 2
    """Steps excluded from timing (must be < steps)."""
    log_every: int = 5
    """Steps between the live throughput and memory points of a run (``step/*`` metrics: tokens/s, TFLOP/s, MFU,
    memory) and the console step line (xpar.run.console: loss, gradient norm, memory, tokens/s, TFLOP/s, MFU; also in
    the run's xpar.log); the last step always logs. Loss, step time, gradient norm and lr log to MLflow every step."""
    profile: bool = False
    """Trace the last 2 steps (the run's last, with fewer) of every rank with torch.profiler (xpar.run.profile):
    Chrome trace files ``profile/rank<r>_trace.json`` in the run folder, logged as MLflow artifacts (open them in
    chrome://tracing or ui.perfetto.dev). Those steps are timed with the profiler's overhead."""
    global_batch_size: Any = "auto"
    """Sequences per optimizer step (B = b * m * dp), or 'auto' to derive it."""
    micro_batch_size: int = 4
    """Sequences per micro-batch (b)."""
    seq_len: Optional[int] = None
    """Training sequence length; None uses model.seq_len."""
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled, Loshchilov & Hutter 2019)."""
    dtype: str = "fp32"
    """fp32 (pure fp32) or bf16: mixed precision -- bf16 compute, fp32 master weights and
    AdamW states, fp32 gradient reduction and loss (xpar.parallel.precision)."""
    fp8_recipe: str = "delayed"
    """Under dtype=fp8 (estimated), how the linear layers quantise to FP8 (Transformer Engine's recipes;
    xpar.estimate.compute.fp8_recipes): 'delayed' (DelayedScaling: one cast pass from an amax history, the
    default), 'current' (per-tensor current scaling, FP8-CS, torchao tensorwise: an amax pass, then the
    cast), 'mxfp8' (MXFP8 block scaling, E8M0 scale per 32 elements, rowwise and columnwise copies;
    Blackwell only: hardware.mxfp8), 'blockwise' (DeepSeek-V3's 1x128 / 128x128 FP8 blocks). Priced by
    the kernel model (quantise passes as memory traffic, the recipe's GEMM rate); unused under bf16/fp32."""
    compile: bool = False
    """Blocks compiled by torch.compile (estimated only: element-wise passes fused; estimate.compute.kernel_costs)."""
    compile_loss: bool = False
    """The loss compiled too (torchtitan PR 1033, 2025-04; estimated only; estimate.memory.activations.loss_bytes)."""
    seed: int = 0
    """Seed of the model's initial weights and of the synthetic data."""
    threads_per_worker: Optional[int] = None
    """torch threads per worker on CPU (torch.set_num_threads); None = 1."""
    on_nonfinite: str = "stop"
    """A step whose loss or global gradient norm is NaN or inf (checked every step on every
    rank, xpar.parallel.optim.check_finite): 'stop' ends the run FAILED naming the step, rank and value;
    'skip' skips that optimizer step (and its lr step) and counts it (train/skipped_steps);
    'ignore' steps anyway and counts it (train/nonfinite_steps). Either count marks the run
    diverged (tag xpar.diverged): its throughput is not a clean measurement."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global L2 norm of the whole model's gradient to this (xpar.parallel.optim); null
    disables clipping (the pre-clip norm is still measured and logged)."""
    lr_schedule: str = "constant"
    """'constant' (the default) or 'cosine': linear warm-up over lr_warmup_steps, then lr
    fixed, or cosine decay to min_lr_ratio * lr at the last step (xpar.parallel.optim.lr_factor)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear lr warm-up (either schedule); not the timing warm-up."""
    min_lr_ratio: float = 0.1
    """Final lr / lr of the cosine schedule (0..1)."""
    checkpoint_every: Optional[int] = None
    """Save a checkpoint (torch.distributed.checkpoint, xpar.run.checkpoint) every this many
    optimizer steps; null or 0: none."""
    checkpoint_dir: Optional[str] = None
    """Where checkpoints go, one ``step_<k>`` directory each; null: ``<run output dir>/checkpoints``."""
    checkpoint_keep: Optional[int] = None
    """Keep only this run's newest this many checkpoints (older ones are deleted once a newer
    one is complete); null: keep all."""
    resume: Optional[str] = None
    """Resume from a checkpoint: a ``step_<k>`` directory, a checkpoints or run output directory
    (its newest checkpoint), or 'latest' (the newest under train.checkpoint_dir, else under
    outputs/ and multirun/). Not logged as a param: the resumed run's tags say where from."""


@dataclass
class DataConfig:
    """Where tokens come from."""

    kind: str = "synthetic"
    """'synthetic' (seeded random tokens) or 'text' (byte-level tokens of a local file)."""
    path: Optional[str] = None
    """Text file for kind=text."""


@dataclass
class TrackingConfig:
    """MLflow."""

    enabled: bool = True
    """Record the run in MLflow (tracking=off sets false: nothing is recorded)."""
    uri: Optional[str] = None
    """Tracking URI; None = sqlite:///<directory xpar was started from>/mlflow.db."""
    experiment: str = "xpar"
    """MLflow experiment name (must not be empty)."""
    artifact_location: Optional[str] = None
    """Artifact root for a new experiment; None = <start directory>/mlartifacts."""
    run_name: Optional[str] = None
    """MLflow run name; None names the run after its layout (e.g. "tiny dp2 zero1")."""


@dataclass
class RunConfig:
    """How to run the layout."""

    mode: str = "auto"
    """auto | execute | estimate | plan. auto executes where the devices exist, else estimates; plan
    searches every layout (xpar plan, xpar.plan.command)."""
    progress: bool = True
    """Show a rich progress bar of the steps on the console."""
    fail_rank: Optional[int] = None
    """Fault injection for testing failure handling: this rank raises after building its engine."""
    hang_rank: Optional[int] = None
    """Fault injection: this rank's main thread sleeps after building its engine while its heartbeat
    beats and the other ranks wait in a collective (a hang the watchdog must name, xpar.run.launch)."""
    allow_long: bool = False
    """Run a local job whose estimated training time exceeds an hour (xpar.estimate.preflight.duration)."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective (gloo/NCCL), seconds: a rank waiting longer raises. Local workers: a run
    in which no rank finished a step for this long (all waiting on each other, e.g. in a pipeline's
    send/recv, which gloo does not time out) is named as hung and ended (xpar.run.launch.hung_run)."""
    heartbeat_timeout_s: float = 30.0
    """Local workers beat every second; one silent this long (stopped, hung outside Python's
    reach) is named and the job ended (xpar.run.launch)."""
    dry_run: bool = True
    """Estimate mode: also build the representative ranks through the engine factory on a fake
    process group (xpar.run.dryrun) and check the cost model's parameter bytes against them."""


@dataclass
class SweepConfig:
    """Multirun sweeps (``-m``)."""

    skip_invalid: bool = False
    """Pre-flight: skip jobs whose config is invalid (True) or stop the sweep before any job runs."""
    metric: str = "throughput/tokens_per_s"
    """Metric that picks the sweep's best job."""
    goal: str = "max"
    """'max' or 'min' of ``metric``."""
    max_failure_rate: float = 1.0
    """Optuna sweeper: share of failed or skipped trials per batch above which the sweep stops
    (hydra.sweeper.max_failure_rate); 1.0 goes on whatever fails."""


@dataclass
class PlanConfig:
    """``xpar plan`` (run.mode=plan): the constraints on the layouts searched (xpar.plan.space), what it shows."""

    global_batch_size: Any = "auto"
    """Sequences per step: a number, a range [lo, hi] (lo, hi, powers of two between), or 'auto': train.global_batch_size,
    else the stated layout's (micro_batch_size x parallel.micro_batches x dp where the count is a number, as a cluster
    preset states it), else 2^22 tokens / seq_len as a power of two >= the devices (Llama 2/3); local: devices x
    micro_batch_size."""
    devices: Any = None
    """Devices: null (the preset's), a number, or a whole-node range [lo, hi] with ``min_tokens_per_s``."""
    min_tokens_per_s: Optional[float] = None
    """Throughput the smallest cluster of a ``devices`` range must reach (tokens/s)."""
    max_tp: Optional[int] = None
    """Largest tensor-parallel degree; null: any tp dividing the heads (inside or across nodes)."""
    pp: Optional[int] = None
    """Fixed pipeline degree; null: any."""
    cp: Optional[list] = None
    """Context-parallel degrees; null: 1 and the powers of two leaving each cp rank >= 4096 tokens (xpar.plan.axes)."""
    ep: Optional[list] = None
    """Expert-parallel degrees; null: a MoE model's divisors of n_experts, [1] when dense (xpar.plan.axes)."""
    dtype: Optional[list] = None
    """Training dtypes searched (e.g. [bf16, fp8]); null: [train.dtype]."""
    schedules: Optional[list] = None
    """Pipeline schedules allowed (xpar.config.layout.SCHEDULES); null: those the framework runs (framework.schedules)."""
    zero_stages: Optional[list] = None
    """ZeRO stages allowed; null: those the framework runs (framework.zero_stages)."""
    recompute: Optional[list] = None
    """Recompute policies allowed (xpar.config.remat.RECOMPUTE); null: framework.recompute, else none, selective, full."""
    sequence_parallel: Optional[list] = None
    """Sequence parallelism allowed ([false], [true] or both); null: both (with tp > 1)."""
    offload: Optional[list] = None
    """Optimizer offload allowed ([false], [true] or both); null: the framework's (framework.offload)."""
    max_micro_batch_size: int = 16
    """Largest micro-batch size b tried (sequences): every b dividing the global batch (torchtitan runs b 12, 16);
    layouts that do not fit are dropped by memory."""
    memory_headroom: Optional[float] = None
    """Fraction of device memory kept free; null: hardware.memory_headroom where above 0, else 0.08 on a GPU (the CUDA
    context, cuBLAS/NCCL workspaces and the caching allocator's fragmentation: xpar.plan.inputs.GPU_HEADROOM), 0 on a CPU."""
    top_k: int = 10
    """Degree groups shown in the ranked table (the best layout of each; xpar.plan.groups)."""
    tie_within: float = 0.05
    """Layouts within this fraction of the winner's tokens/s are marked as ties (the estimator's stated
    median error on published runs is 5-10 %: docs/accuracy/published.md)."""
    execute_top: int = 0
    """hardware=local: run this many top layouts for real (an MLflow sweep), compare estimated with measured."""
    etp: Optional[list] = None
    """Expert tensor-parallel degrees (each dividing tp; 0: etp = tp); null: [0]. [0,1] adds MoE parallel folding
    (etp 1, experts whole per rank, ep over tp ranks too), 2-3 x a MoE plan's layouts (xpar.plan.axes)."""
    virtual_stages: Optional[list] = None
    """Virtual stages per rank v tried by looped schedules (interleaved_1f1b, looped_bfs); null: 2-8 and the divisors
    of n_layers (xpar.plan.space.schedule_pairs)."""


@dataclass
class XparConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    framework: FrameworkConfig = field(default_factory=FrameworkConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


GROUPS = ("model", "parallel", "hardware", "train", "data", "tracking", "framework")


def register_configs() -> None:
    """Register the schema as ``xpar_schema`` (the first entry of conf/config.yaml's defaults)."""
    cs = ConfigStore.instance()
    cs.store(name="xpar_schema", node=XparConfig)


register_configs()


SUMMARY_METRICS = ("throughput/tokens_per_s", "throughput/tokens_per_s_per_device", "throughput/step_time_s",
                   "throughput/tflops_per_device", "throughput/mfu", "throughput/hfu", "memory/peak_bytes_per_device",
                   "memory/model_states_bytes", "train/final_loss")
"""The summary metrics every run logs (:meth:`xpar.track.report.Report.metrics`, besides its memory terms and extras)."""
