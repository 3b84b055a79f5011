"""Real MoE models as presets: their published shapes, each field with its source.

The simulator prices them at their real size (``preset("mixtral_8x7b").config()``); the runtime
trains them scaled down (``.config(scale=1/64)``: widths, heads and layers times ``scale``, the
expert count, top-k and sequence length kept, since routing is what moelab studies; the vocabulary
is the base config's, which matches its dataset, byte-level by default). What moelab's
transformer cannot express (grouped-query or latent attention, SwiGLU's third matrix, shared
experts, dense first layers) is listed in ``not_modelled`` and goes into every label that uses the
preset: a preset is the model's *MoE shape*, not the model. A preset too big for this machine is
refused before any process starts (:func:`moelab.runtime.memory.fits_memory`, every real run's check).
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Preset:
    name: str
    title: str
    fields: dict  # dotted config path -> (value, source)
    not_modelled: tuple

    def config(self, base: RunConfig | None = None, scale: float = 1.0) -> RunConfig:
        """``base`` (default: moelab's defaults) with the preset's shape; ``scale`` < 1 shrinks
        d_model, d_ff, heads and layers (not experts, top-k or sequence length)."""
        if not 0 < scale <= 1:
            raise ConfigError(f"preset scale must be in (0, 1], got {scale!r}")
        values = {k: v for k, (v, _) in self.fields.items()}
        if scale < 1:
            del values["model.vocab_size"]  # the data's vocabulary, not the model's
            heads = max(1, round(values["model.n_heads"] * scale))
            head_dim = max(4, round(values["model.d_model"] * scale / heads))
            values.update({"model.n_heads": heads, "model.d_model": heads * head_dim,
                           "model.d_ff": max(4, round(values["model.d_ff"] * scale)),
                           "model.n_layers": max(values.get("model.moe_every", 1),
                                                 round(values["model.n_layers"] * scale))})
        cfg = (base or RunConfig()).with_overrides({**values, "name": self.name if scale == 1 else
                                                    f"{self.name}-x{scale:g}"})
        return cfg

    def sources(self) -> dict:
        return {k: src for k, (_, src) in self.fields.items()}

    @property
    def label(self) -> str:
        return f"{self.title} MoE shape (not modelled: {', '.join(self.not_modelled)})"


MIXTRAL = "Mixtral of Experts, arXiv:2401.04088, Table 1"
SWITCH = "google/switch-base-128 config.json (Switch Transformers, arXiv:2101.03961)"
DSV3 = "DeepSeek-V3 Technical Report, arXiv:2412.19437, Sec. 4.2"
DSV3_HF = "deepseek-ai/DeepSeek-V3 config.json"
QWEN3 = "Qwen/Qwen3-30B-A3B config.json"

PRESETS = {p.name: p for p in (
    Preset("switch_base_128", "Switch-Base-128", {
        "model.arch": ("bert", "encoder of the T5-style encoder-decoder (masked LM here)"),
        "model.d_model": (768, SWITCH), "model.d_ff": (3072, SWITCH), "model.n_layers": (12, SWITCH),
        "model.n_heads": (12, SWITCH), "model.vocab_size": (32128, SWITCH), "model.seq_len": (512, SWITCH),
        "model.moe_every": (2, SWITCH + ": encoder_sparse_step 2"), "model.moe.num_experts": (128, SWITCH),
        "model.moe.top_k": (1, SWITCH + ": top-1 routing"), "model.moe.gate": ("switch", SWITCH),
        "model.moe.capacity_factor": (1.25, "Switch Transformers Sec. 2.2, training capacity factor")},
        ("the decoder stack", "relative position bias")),
    Preset("mixtral_8x7b", "Mixtral-8x7B", {
        "model.d_model": (4096, MIXTRAL), "model.d_ff": (14336, MIXTRAL), "model.n_layers": (32, MIXTRAL),
        "model.n_heads": (32, MIXTRAL), "model.vocab_size": (32000, MIXTRAL),
        "model.seq_len": (4096, "a training window; the model's context is 32768 (Table 1)"),
        "model.moe.num_experts": (8, MIXTRAL), "model.moe.top_k": (2, MIXTRAL),
        "model.moe.expert_bias": (False, MIXTRAL + ": bias-free FFNs"),
        "model.moe.activation": ("gelu", "SwiGLU approximated")},
        ("grouped-query attention (8 KV heads)", "SwiGLU's third matrix", "RoPE")),
    Preset("deepseek_v3", "DeepSeek-V3", {
        "model.d_model": (7168, DSV3), "model.d_ff": (2048, DSV3 + ": routed expert hidden size"),
        "model.n_layers": (61, DSV3), "model.n_heads": (128, DSV3), "model.vocab_size": (129280, DSV3_HF),
        "model.seq_len": (4096, DSV3 + ": pre-training sequence length"),
        "model.moe.num_experts": (256, DSV3 + ": routed experts"), "model.moe.top_k": (8, DSV3),
        "model.moe.expert_bias": (False, DSV3_HF)},
        ("multi-head latent attention", "the shared expert", "the 3 dense first layers (all 61 are MoE here)",
         "node-limited routing", "multi-token prediction")),
    Preset("qwen3_30b_a3b", "Qwen3-30B-A3B", {
        "model.d_model": (2048, QWEN3), "model.d_ff": (768, QWEN3 + ": moe_intermediate_size"),
        "model.n_layers": (48, QWEN3), "model.n_heads": (32, QWEN3), "model.vocab_size": (151936, QWEN3),
        "model.seq_len": (4096, "a training window; max_position_embeddings is 40960"),
        "model.moe.num_experts": (128, QWEN3), "model.moe.top_k": (8, QWEN3 + ": num_experts_per_tok"),
        "model.moe.gate": ("topk", QWEN3 + ": norm_topk_prob true"), "model.moe.expert_bias": (False, QWEN3)},
        ("grouped-query attention (4 KV heads)", "SwiGLU's third matrix", "RoPE")),
)}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
