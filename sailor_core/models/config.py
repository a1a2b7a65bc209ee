"""Transformer configurations and their analytic per-layer sizes. Torch-free.

Contract:
- `TransformerConfig` is a frozen, validated description of a decoder-only transformer in one of
  four variants: 'opt' (learned positions, LayerNorm, ReLU MLP, tied head), 'gpt-neo' (learned
  positions, LayerNorm, GELU MLP, tied head), 'gpt-neox' (rotary positions on `rotary_pct` of each
  head, LayerNorm, GELU MLP, untied head, optionally the parallel residual) and 'llama' (rotary
  positions, RMSNorm, SwiGLU MLP, untied head, no biases, grouped-query attention when
  `num_kv_heads` < `num_heads`). `tied_head` may be overridden per config.
- One registry: `get_config(name)` finds a built-in config (`BUILTIN_CONFIGS`) or one registered
  with `register_config` (e.g. read from a Hugging Face config.json by sailor_core.models.hf_config);
  `to_dict`/`config_from_dict` carry a config to worker processes, so the profiler, planner and
  runtime size and build the same model from one description.
  Built-in: gpt-tiny, gpt-small, gpt-wide, OPT-350, GPT-Neo-2.7, LLAMA-3-8, OPT-30 (sailor_core.catalog).
- `model_spec(config, tp_degrees)` returns a `ModelSpec` in the store's layer indexing
  (0 embedding, 1..L blocks, L+1 final norm + head) with, per layer and TP degree:
  `params` held by one GPU of the TP group, `act_input_elems`/`act_output_elems` per sequence, and
  `act_memory_bytes` kept for backward per sequence. The activation formula counts exactly the
  tensors that sailor_core.models.torch_model saves for backward (see `_block_saved_elems`), so a
  profiler that hooks torch's saved tensors finds the same bytes. `flops_per_token()` is the
  training FLOPs per token (6N + 12 L H Q T).

The torch implementation lives in torch_model.py / tensor_parallel.py; importing this module (or
the package) never imports torch, so the planner and simulator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sailor_core.catalog import MODEL_ARCHITECTURES
from sailor_core.domain import LayerSpec, ModelSpec
from sailor_core.errors import SailorError, ValidationError

VARIANTS = ("opt", "gpt-neo", "gpt-neox", "llama")

# Bytes per element of what backward keeps: the runtime keeps fp32 activations unless bf16
# autocast is on; the spec is stated at fp32 (the profiler measures fp32 by default).
FP32_BYTES = 4
INDEX_BYTES = 8  # token ids and targets are int64


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer. `num_blocks` transformer blocks; the store sees num_blocks + 2 layers."""

    name: str
    variant: str
    num_blocks: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    sequence_length: int
    vocab_size: int
    tied_head: bool | None = None  # None: the variant's default (opt, gpt-neo tie; llama, gpt-neox do not)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    num_kv_heads: int | None = None  # grouped-query attention; None: one KV head per query head
    rotary_pct: float = 1.0  # share of each head's dimensions that rotary positions turn (gpt-neox)
    parallel_residual: bool = False  # x + attn(ln1(x)) + mlp(ln2(x)) (gpt-neox's default)
    position_offset: int = 0  # learned positions start at this row (OPT keeps 2 unused rows)
    # positions the model was built for (Hugging Face's max_position_embeddings; None: sequence_length):
    # a learned position table has this many rows (+ offset) whatever length is trained
    max_positions: int | None = None
    qkv_bias: bool = False  # biases on the query/key/value projections only (Qwen2); other variants' own biases
    sliding_window: int | None = None  # attention window of the source model (>= sequence_length: full attention)
    hf_model_type: str | None = None  # the config.json's model_type it was read from (llama, mistral, qwen2, ...)
    # rotary frequency scaling for contexts longer than trained: None, "linear" (frequencies / factor)
    # or "llama3" (Llama 3.1's: low frequencies / factor, high kept, a smooth ramp between)
    rope_scaling: str | None = None
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 0
    # how the source config.json held its rotary settings: under `rope_parameters` (transformers >= 5)
    # or as top-level rope_theta / rope_scaling / rotary_pct (older); an export writes them the same
    # way. Presentation, not architecture: two configs that differ only here are the same model.
    hf_rope_parameters: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValidationError(f"model config {self.name!r}: {msg}")

        if self.variant not in VARIANTS:
            bad(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        for n in ("num_blocks", "hidden_size", "num_heads", "ffn_hidden_size", "sequence_length", "vocab_size"):
            if int(getattr(self, n)) < 1:
                bad(f"{n} must be >= 1, got {getattr(self, n)}")
        if self.hidden_size % self.num_heads:
            bad(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            bad(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.kv_heads != self.num_heads and self.variant != "llama":
            bad(f"grouped-query attention (num_kv_heads {self.kv_heads}) is only built for variant 'llama'")
        if not 0.0 < self.rotary_pct <= 1.0:
            bad(f"rotary_pct must be in (0, 1], got {self.rotary_pct}")
        if self.rotary and self.rotary_dims % 2:
            bad(f"rotary positions need an even number of rotated dimensions, got {self.rotary_dims}")
        if self.rope_scaling not in (None, "linear", "llama3") or (self.rope_scaling and not self.rotary):
            bad(f"rope_scaling must be linear or llama3 on a rotary model, got {self.rope_scaling!r}")
        if self.rope_scaling and self.rope_factor <= 0:
            bad(f"rope_factor must be > 0, got {self.rope_factor}")
        if self.rope_scaling == "llama3" and (self.rope_original_max_positions < 1
                                              or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            bad(
                "llama3 rope scaling needs original_max_position_embeddings >= 1 and high_freq_factor > low_freq_factor"
            )
        if self.parallel_residual and self.variant != "gpt-neox":
            bad("parallel_residual is a gpt-neox option")
        if self.qkv_bias and self.variant != "llama":
            bad("qkv_bias is a llama-family option (the other variants have biases everywhere)")
        if self.sliding_window is not None and self.sliding_window < self.sequence_length:
            bad(f"sliding-window attention over {self.sliding_window} tokens is not built (sequence_length "
                f"{self.sequence_length}); to fix: train sequences of at most {self.sliding_window} tokens")
        if self.max_positions is not None and self.max_positions < self.sequence_length:
            bad(f"sequence_length {self.sequence_length} is longer than max_positions {self.max_positions}")
        if self.position_offset < 0 or (self.position_offset and not self.learned_positions):
            bad(f"position_offset must be >= 0 and needs learned positions, got {self.position_offset}")
        if self.tied_head is None:
            object.__setattr__(self, "tied_head", self.variant in ("opt", "gpt-neo"))

    # -- derived ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Layers in the store's indexing: embedding, blocks, final norm + head."""
        return self.num_blocks + 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return int(self.num_kv_heads or self.num_heads)

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV projection: every query head plus one key and one value per KV head."""
        return (self.num_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def learned_positions(self) -> bool:
        return self.variant in ("opt", "gpt-neo")

    @property
    def position_rows(self) -> int:
        """Rows of a learned position table."""
        return (self.max_positions or self.sequence_length) + self.position_offset

    @property
    def rotary(self) -> bool:
        return self.variant in ("llama", "gpt-neox")

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def norm(self) -> str:
        return "rmsnorm" if self.variant == "llama" else "layernorm"

    @property
    def mlp(self) -> str:
        return {"opt": "relu", "gpt-neo": "gelu", "gpt-neox": "gelu", "llama": "swiglu"}[self.variant]

    @property
    def bias(self) -> bool:
        return self.variant != "llama"

    def layer_kind(self, index: int) -> str:
        if not 0 <= index < self.num_layers:
            raise SailorError(f"model {self.name} has layers 0..{self.num_layers - 1}, not {index}")
        if index == 0:
            return "embedding"
        return "head" if index == self.num_layers - 1 else "block"

    def check_tp(self, tp: int) -> None:
        """TP splits heads (whole KV groups), FFN and vocabulary evenly; say which does not divide."""
        if tp < 1:
            raise SailorError(f"tp must be >= 1, got {tp}")
        for what, n in (("num_heads", self.num_heads), ("num_kv_heads", self.kv_heads),
                        ("ffn_hidden_size", self.ffn_hidden_size), ("vocab_size", self.vocab_size)):
            if n % tp:
                raise SailorError(
                    f"model {self.name}: {what}={n} is not divisible by tp={tp}; to fix: use a TP degree dividing {n}"
                )

    def num_params(self) -> int:
        """Total parameters of the model (a tied head counted once)."""
        spec = model_spec(self, (1,))
        total = sum(ly.params for ly in spec.layers)
        if self.tied_head:
            total -= self.vocab_size * self.hidden_size
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward = 3 x forward), PaLM's / nanoGPT's estimate:
        6 x the parameters that multiply activations (blocks and the vocabulary projection; the
        embedding lookup does no arithmetic) + 12 x layers x heads x head_dim x sequence (attention
        scores and their weighted sum, causal mask not discounted). Recomputation adds a forward of
        the blocks that this count, like MFU's, leaves out."""
        blocks = sum(layer_params(self, i) for i in range(1, self.num_blocks + 1))
        matmul = blocks + self.vocab_size * self.hidden_size
        return 6 * matmul + 12 * self.num_blocks * self.num_heads * self.head_dim * self.sequence_length

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able fields (worker assignments carry the model this way)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def config_from_dict(d: dict[str, object]) -> TransformerConfig:
    known = set(TransformerConfig.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValidationError(f"model config has unknown fields {unknown}; known: {sorted(known)}")
    return TransformerConfig(**d)  # type: ignore[arg-type]


def _norm_params(cfg: TransformerConfig) -> int:
    return cfg.hidden_size * (1 if cfg.norm == "rmsnorm" else 2)


def layer_params(cfg: TransformerConfig, index: int, tp: int = 1) -> int:
    """Parameters one GPU of a `tp`-way group holds for this layer (replicated tensors counted fully)."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    kind = cfg.layer_kind(index)
    if kind == "embedding":
        # vocab-parallel token embedding; learned positions are replicated
        return v * h // tp + (cfg.position_rows * h if cfg.learned_positions else 0)
    if kind == "head":
        # final norm (replicated) + vocab-parallel output projection without bias; a tied head
        # still holds its own copy when it lives on another stage, so it is counted here too
        return _norm_params(cfg) + v * h // tp
    b = 1 if cfg.bias else 0
    q = cfg.qkv_size
    attn = q * h // tp + (1 if cfg.bias or cfg.qkv_bias else 0) * q // tp + h * h // tp + b * h
    if cfg.mlp == "swiglu":
        mlp = 2 * h * f // tp + f * h // tp
    else:
        mlp = h * f // tp + b * f // tp + f * h // tp + b * h
    return 2 * _norm_params(cfg) + attn + mlp


def _norm_saved_elems(cfg: TransformerConfig, s: int) -> int:
    # LayerNorm keeps its input and per-token mean and rstd; torch's RMSNorm is composite and
    # keeps its input, the per-token rstd and the normalised tensor before the weight
    if cfg.norm == "rmsnorm":
        return 2 * s * cfg.hidden_size + s
    return s * cfg.hidden_size + 2 * s


def _block_saved_elems(cfg: TransformerConfig, tp: int) -> int:
    """Elements (fp32) a block keeps for backward per sequence, as torch_model.Block computes it.

    Attention: norm input + stats; the norm's output (the QKV projection's input); the QKV output
    (q, k, v are views of it that attention keeps); with rotary, the rotated q and k; attention's
    output (already laid out as the out projection's input, so kept once) and log-sum-exp.
    MLP: norm input + stats; its output (FC1's input); GELU keeps FC1's output and FC2 keeps
    GELU's output; ReLU keeps only its output (= FC2's input); SwiGLU keeps gate, up, silu(gate)
    and the product.
    """
    s, h, f, nh = cfg.sequence_length, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_heads
    # norm input + stats, its output, q/k/v as attention keeps them, attention's output, log-sum-exp
    attn = _norm_saved_elems(cfg, s) + s * h + 3 * s * h // tp + s * h // tp + s * nh // tp
    if cfg.kv_heads == nh and cfg.rotary:
        # the rotated q and k are new tensors next to the QKV output (v stays a view of it), and
        # attention's output is laid out apart from the out projection's input, which keeps a copy
        attn += 3 * s * h // tp
    # grouped-query attention: q (gathered from its groups, rotated), k (rotated, repeated) and v
    # (repeated to every query head) are new tensors, the QKV output is not kept, and attention's
    # output is already the out projection's input
    mlp = _norm_saved_elems(cfg, s) + s * h
    if cfg.parallel_residual:  # both norms read the block's input: kept once
        mlp -= s * h
    mlp += {"relu": 1, "gelu": 2, "swiglu": 4}[cfg.mlp] * s * f // tp
    return attn + mlp


def layer_activation_bytes(cfg: TransformerConfig, index: int, tp: int = 1) -> int:
    """Bytes one GPU of a `tp`-way group keeps for backward for one sequence (fp32 activations)."""
    s, h, v = cfg.sequence_length, cfg.hidden_size, cfg.vocab_size
    kind = cfg.layer_kind(index)
    if kind == "embedding":
        # only the token ids are needed to scatter the embedding gradient (plus a mask under TP)
        return s * INDEX_BYTES + (s if tp > 1 else 0)
    if kind == "head":
        # final norm input + stats, its output (the projection's input), the softmax over this TP
        # rank's share of the vocabulary (vocab-parallel cross-entropy's backward needs it), and
        # the targets (under TP: this rank's target indices and a mask of the tokens it owns)
        return FP32_BYTES * (_norm_saved_elems(cfg, s) + s * h + s * v // tp) + s * INDEX_BYTES + (s if tp > 1 else 0)
    return FP32_BYTES * _block_saved_elems(cfg, tp)


def model_spec(cfg: TransformerConfig, tp_degrees: tuple[int, ...] | list[int] = (1, 2, 4, 8)) -> ModelSpec:
    """Per-layer sizes for every TP degree in `tp_degrees` that divides heads, FFN and vocabulary."""
    s, h = cfg.sequence_length, cfg.hidden_size
    tps = []
    for tp in tp_degrees:
        try:
            cfg.check_tp(int(tp))
        except SailorError:
            continue
        tps.append(int(tp))
    if not tps:
        raise SailorError(f"model {cfg.name}: none of tp degrees {list(tp_degrees)} divides heads, FFN and vocabulary")
    layers = []
    for tp in sorted(set(tps)):
        for i in range(cfg.num_layers):
            kind = cfg.layer_kind(i)
            layers.append(
                LayerSpec(
                    index=i,
                    kind=kind,
                    tp=tp,
                    params=layer_params(cfg, i, tp),
                    act_input_elems=s if kind == "embedding" else s * h,
                    act_output_elems=1 if kind == "head" else s * h,
                    act_memory_bytes=layer_activation_bytes(cfg, i, tp),
                )
            )
    return ModelSpec(
        name=cfg.name,
        num_blocks=cfg.num_blocks,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        sequence_length=cfg.sequence_length,
        vocab_size=cfg.vocab_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        layers=tuple(layers),
        tied_head=bool(cfg.tied_head),
    )


def _builtin() -> dict[str, TransformerConfig]:

    variants = {"OPT-350": "opt", "OPT-30": "opt", "GPT-Neo-2.7": "gpt-neo", "LLAMA-3-8": "llama"}
    out = {
        # Small models that train on a CPU in minutes; byte-level vocabulary, untied head so a
        # pipeline never has to synchronise a weight shared by its first and last stage.
        "gpt-tiny": TransformerConfig(
            name="gpt-tiny", variant="gpt-neo", num_blocks=4, hidden_size=128, num_heads=4,
            ffn_hidden_size=512, sequence_length=128, vocab_size=256, tied_head=False,
        ),
        "gpt-small": TransformerConfig(
            name="gpt-small", variant="gpt-neo", num_blocks=6, hidden_size=256, num_heads=8,
            ffn_hidden_size=1024, sequence_length=256, vocab_size=256, tied_head=False,
        ),
        # Wide and shallow, for tensor parallelism on CPU devices: a block's compute grows with hidden^2
        # while a TP all-reduce moves sequence x hidden, so at hidden 512 two devices' halves of a block
        # finish well before one device's whole block even with gloo's four all-reduces per block
        # (gpt-tiny's blocks are too small: the all-reduces dominate). The geo testbed demo's model.
        "gpt-wide": TransformerConfig(
            name="gpt-wide", variant="gpt-neo", num_blocks=4, hidden_size=512, num_heads=8,
            ffn_hidden_size=2048, sequence_length=128, vocab_size=256, tied_head=False,
        ),
    }
    # gpt-tiny's shape as an OPT block (ReLU MLP, head tied to the embedding): exercises weight tying
    out["opt-tiny"] = replace(out["gpt-tiny"], name="opt-tiny", variant="opt", tied_head=True)
    for name, arch in MODEL_ARCHITECTURES.items():
        out[name] = TransformerConfig(
            name=name, variant=variants.get(name, "gpt-neo"), num_blocks=arch["num_blocks"],
            hidden_size=arch["hidden_size"], num_heads=arch["num_heads"], ffn_hidden_size=arch["ffn_hidden_size"],
            sequence_length=arch["sequence_length"], vocab_size=arch["vocab_size"],
        )
    return out


BUILTIN_CONFIGS: dict[str, TransformerConfig] = _builtin()
_REGISTERED: dict[str, TransformerConfig] = {}


def register_config(cfg: TransformerConfig) -> TransformerConfig:
    """Make `cfg` known to `get_config` in this process (a config read from a file, say).

    A built-in name, or a registered name with another architecture, is refused: one name means
    one model everywhere (profiles in the store are keyed by it)."""
    for known in (BUILTIN_CONFIGS, _REGISTERED):
        for key, old in known.items():
            if key.lower() == cfg.name.lower() and old != cfg:
                raise SailorError(
                    f"model name {cfg.name!r} is already another model's; to fix: give this config another name"
                )
    _REGISTERED[cfg.name] = cfg
    return cfg


def get_config(name: str, **overrides: object) -> TransformerConfig:
    """A built-in or registered config by name (case-insensitive), optionally with fields replaced."""
    for known in (BUILTIN_CONFIGS, _REGISTERED):
        for key, cfg in known.items():
            if key.lower() == name.lower():
                return replace(cfg, **overrides) if overrides else cfg  # type: ignore[arg-type]
    raise SailorError(
        f"unknown model {name!r}; to fix: use one of {', '.join(BUILTIN_CONFIGS)}, or pass --model-config config.json"
    )
