"""Independent reference implementations of the weight-loading rules.

Written from ../shared/reference/LAYOUTS.md (§2-8), the way engine weight loaders and
Megatron converters do it: plain tensor ops (``narrow``, ``cat``, ``view``) on full
HuggingFace tensors.  Nothing here uses shardsync's layouts or plans, so agreement
between the two is evidence that both follow the documented rules; only ``ModelSpec``
is read, for its numbers.

GLM4 (``Glm4ForCausalLM``) is not in LAYOUTS.md; its rules here follow the HF checkpoint
(``post_self_attn_layernorm``/``post_mlp_layernorm`` ``[H]`` per layer, one fused
``mlp.gate_up_proj [2F, H]`` = ``[gate; up]``) with the same loaders: the extra norms are
replicated, and the fused tensor is chunked into gate and up before the usual §5 / §7.2
narrow, so Megatron ``linear_fc1`` and engine ``gate_up_proj`` keep ``[gate_r; up_r]``.

GLM4-MoE (``Glm4MoeForCausalLM``, GLM-4.5) is LAYOUTS.md §8 with the DeepSeek-style rows of
the §8.1 table: its dense layers are the first ``first_k_dense_replace`` (no sparse step);
a sparse layer's router has the correction bias ``mlp.gate.e_score_correction_bias [E]``
(Megatron ``mlp.router.expert_bias``, replicated like the router), and after the routed
experts come the shared experts ``mlp.shared_experts.{gate,up,down}_proj`` (``Is`` =
``moe_intermediate_size * n_shared_experts``), a dense gated MLP split over the *attention*
TP by the §5 / §7.2 rules (Megatron ``shared_experts.linear_fc1/fc2``, engine
``shared_experts.gate_up_proj/down_proj``), never over ETP / EP.  Its attention bias and
q/k norms are config keys (``attention_bias``, ``use_qk_norm``), read from the spec's raw
fields ``attention_bias`` / ``qk_layernorm`` (``None``: the family default below).

``synthetic_full`` fills every logical tensor with distinct positive integers (exact in
float32 below 2**24), so a value names its own tensor and coordinates and zero means
padding (or "never written").
"""

from __future__ import annotations

import torch

from shardsync.spec import ModelSpec

# Architecture flags per family (LAYOUTS.md §2.2 "Flags behind the optional rows");
# Qwen3-MoE has Qwen3's attention (q/k norm, no bias).  GLM4 (HF ``Glm4ForCausalLM``,
# GLM-4-0414): Qwen2-style q/k/v bias, plus a norm after attention and after the MLP, and
# one fused ``mlp.gate_up_proj`` checkpoint tensor ``[gate; up]`` instead of two.
# GLM4-MoE: the defaults of the published GLM-4.5-Air config (attention bias, no q/k norm);
# a spec's explicit ``attention_bias`` / ``qk_layernorm`` wins (``qkv_bias``/``qk_norm`` below).
QKV_BIAS = {"qwen2": True, "qwen3": False, "llama": False, "qwen3_moe": False, "glm4": True, "glm4_moe": True}
QK_NORM = {"qwen2": False, "qwen3": True, "llama": False, "qwen3_moe": True, "glm4": False, "glm4_moe": False}
POST_NORMS = {"qwen2": False, "qwen3": False, "llama": False, "qwen3_moe": False, "glm4": True, "glm4_moe": False}
FUSED_GATE_UP = {"qwen2": False, "qwen3": False, "llama": False, "qwen3_moe": False, "glm4": True,
                 "glm4_moe": False}
# MoE router flavour per family: GLM4-MoE's sigmoid router carries ``e_score_correction_bias``.
CORRECTION_BIAS = {"qwen3_moe": False, "glm4_moe": True}

# GLM4's extra norms: HF / engine name (same spelling in Megatron under ``decoder.layers.N.``),
# after the attention output projection and after the MLP down projection.
POST_ATTN_NORM, POST_MLP_NORM = "post_self_attn_layernorm.weight", "post_mlp_layernorm.weight"

# Megatron names of (input norm, pre-MLP norm) per spec flavour (LAYOUTS.md §2.2).
MEGATRON_NORMS = {
    "fused": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
    "separate": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
}

Shards = list[dict[str, torch.Tensor]]


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def qkv_bias(spec: ModelSpec) -> bool:
    """Whether q/k/v have biases: the config's ``attention_bias`` if given, else the family's."""
    return QKV_BIAS[spec.family] if spec.attention_bias is None else bool(spec.attention_bias)


def qk_norm(spec: ModelSpec) -> bool:
    """Whether attention has q/k norms: the config's ``use_qk_norm`` if given, else the family's."""
    return QK_NORM[spec.family] if spec.qk_layernorm is None else bool(spec.qk_layernorm)


def shared_size(spec: ModelSpec) -> int:
    """``Is``, the shared experts' intermediate size (0: no shared experts)."""
    return spec.shared_expert_intermediate_size if spec.num_experts else 0


def shared_gate_and_up(full: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = f"model.layers.{layer}.mlp.shared_experts."
    return full[a + "gate_proj.weight"], full[a + "up_proj.weight"]


def gate_and_up(spec: ModelSpec, full: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense layer's full HF gate and up weights ``[F, H]`` each.  GLM4 checkpoints hold them
    as one ``gate_up_proj [2F, H]``; its loaders chunk it in two halves (gate first), which
    is what this does (views, no copy)."""
    a = f"model.layers.{layer}.mlp."
    if FUSED_GATE_UP[spec.family]:
        gate, up = full[a + "gate_up_proj.weight"].chunk(2, 0)
        assert gate.shape[0] == up.shape[0] == spec.intermediate_size
        return gate, up
    return full[a + "gate_proj.weight"], full[a + "up_proj.weight"]


def is_sparse(spec: ModelSpec, layer: int) -> bool:
    """Which decoder layers have experts (the rest keep a dense MLP).

    HF Qwen3-MoE: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``.  HF
    GLM4-MoE: every layer from ``first_k_dense_replace`` on (the spec spells the first k dense
    layers as ``mlp_only_layers = (0, ..., k-1)``).
    """
    if spec.num_experts <= 0:
        return False
    if spec.family == "glm4_moe":
        first_k_dense = len(spec.mlp_only_layers)
        assert tuple(spec.mlp_only_layers) == tuple(range(first_k_dense)), spec.mlp_only_layers
        return layer >= first_k_dense
    return layer not in spec.mlp_only_layers and (layer + 1) % spec.decoder_sparse_step == 0


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names and full shapes ([out, in] linears), in checkpoint order; a tied
    lm_head is absent.  A sparse layer has the router (GLM4-MoE: and its correction bias), then
    each expert's gate, up, down, then (GLM4-MoE, ``Is > 0``) the shared experts'."""
    H, h, ng, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    F, V = spec.intermediate_size, spec.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for n in range(spec.num_layers):
        a = f"model.layers.{n}."
        out[a + "input_layernorm.weight"] = (H,)
        out[a + "self_attn.q_proj.weight"] = (h * d, H)
        out[a + "self_attn.k_proj.weight"] = (ng * d, H)
        out[a + "self_attn.v_proj.weight"] = (ng * d, H)
        if qkv_bias(spec):
            out[a + "self_attn.q_proj.bias"] = (h * d,)
            out[a + "self_attn.k_proj.bias"] = (ng * d,)
            out[a + "self_attn.v_proj.bias"] = (ng * d,)
        if qk_norm(spec):
            out[a + "self_attn.q_norm.weight"] = (d,)
            out[a + "self_attn.k_norm.weight"] = (d,)
        out[a + "self_attn.o_proj.weight"] = (H, h * d)
        if POST_NORMS[spec.family]:
            out[a + POST_ATTN_NORM] = (H,)
        out[a + "post_attention_layernorm.weight"] = (H,)
        if is_sparse(spec, n):
            E, Fe = spec.num_experts, spec.moe_intermediate_size
            out[a + "mlp.gate.weight"] = (E, H)
            if CORRECTION_BIAS[spec.family]:
                out[a + "mlp.gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                out[a + f"mlp.experts.{e}.gate_proj.weight"] = (Fe, H)
                out[a + f"mlp.experts.{e}.up_proj.weight"] = (Fe, H)
                out[a + f"mlp.experts.{e}.down_proj.weight"] = (H, Fe)
            Fs = shared_size(spec)
            if Fs:
                out[a + "mlp.shared_experts.gate_proj.weight"] = (Fs, H)
                out[a + "mlp.shared_experts.up_proj.weight"] = (Fs, H)
                out[a + "mlp.shared_experts.down_proj.weight"] = (H, Fs)
            continue
        if FUSED_GATE_UP[spec.family]:
            out[a + "mlp.gate_up_proj.weight"] = (2 * F, H)
        else:
            out[a + "mlp.gate_proj.weight"] = (F, H)
            out[a + "mlp.up_proj.weight"] = (F, H)
        out[a + "mlp.down_proj.weight"] = (H, F)
        if POST_NORMS[spec.family]:
            out[a + POST_MLP_NORM] = (H,)
    out["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out


def synthetic_full(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with ids 1, 2, 3, ... (unique across the model)."""
    out, next_id = {}, 1
    for name, shape in hf_shapes(spec).items():
        n = 1
        for s in shape:
            n *= s
        out[name] = torch.arange(next_id, next_id + n, dtype=torch.float64).reshape(shape).to(dtype)
        next_id += n
    if dtype == torch.float32 and next_id >= 2**24:
        raise ValueError("model too large for exact float32 ids")
    return out


# ---------------------------------------------------------------------------------------
# Engines (SGLang 0.5.x / vLLM): LAYOUTS.md §6.2, §7
# ---------------------------------------------------------------------------------------

def engine_padded_vocab(vocab: int, tp: int) -> int:
    pad = 64
    if _ceil_to(vocab, 64) % tp:
        pad = 64 * tp
    return _ceil_to(vocab, pad)


def _engine_vocab_shard(w: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    V = w.shape[0]
    per = engine_padded_vocab(V, tp) // tp
    lo, hi = min(r * per, V), min((r + 1) * per, V)
    out = torch.zeros((per,) + tuple(w.shape[1:]), dtype=w.dtype)
    out[: hi - lo] = w[lo:hi]
    return out


def sglang_fused_moe(spec: ModelSpec, full: dict[str, torch.Tensor], layer: int, tp: int, ep: int,
                     r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang ``FusedMoE`` of one sparse layer on engine TP rank ``r`` after ``load_weights``.

    LAYOUTS.md §8.3: the TP group of ``tp`` ranks is ``ep`` EP blocks of ``moe_tp = tp/ep``
    consecutive ranks (EP rank ``r // moe_tp``, MoE-TP rank ``r % moe_tp``; the doc marks this
    rank formula unverified).  ``w13_weight [E_loc, 2I/moe_tp, H]``: shard ``w1`` (gate_proj)
    at rows ``[0, I/moe_tp)``, ``w3`` (up_proj) at ``[I/moe_tp, 2I/moe_tp)``; ``w2_weight
    [E_loc, H, I/moe_tp]`` from down_proj's columns.  Written as the loader does it: walk the
    HF expert tensors, skip experts of other EP ranks, narrow to the MoE-TP slice, copy into
    the local expert ``e - ep_rank*E_loc``.
    """
    E, Fe, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    assert tp % ep == 0 and E % ep == 0, (tp, ep, E)
    moe_tp = tp // ep
    assert Fe % moe_tp == 0, (Fe, moe_tp)
    ep_rank, tp_rank = r // moe_tp, r % moe_tp
    e_loc, f = E // ep, Fe // moe_tp
    dtype = full[f"model.layers.{layer}.mlp.gate.weight"].dtype
    w13 = torch.zeros((e_loc, 2 * f, H), dtype=dtype)
    w2 = torch.zeros((e_loc, H, f), dtype=dtype)
    for e in range(E):
        k = e - ep_rank * e_loc
        if not 0 <= k < e_loc:
            continue  # another EP rank's expert
        p = f"model.layers.{layer}.mlp.experts.{e}."
        for shard_id, proj in (("w1", "gate_proj"), ("w3", "up_proj")):
            loaded = full[p + proj + ".weight"].narrow(0, tp_rank * f, f)
            w13[k].narrow(0, 0 if shard_id == "w1" else f, f).copy_(loaded)
        w2[k].copy_(full[p + "down_proj.weight"].narrow(1, tp_rank * f, f))
    return w13, w2


def engine_shards(spec: ModelSpec, full: dict[str, torch.Tensor], tp: int, ep: int = 1) -> Shards:
    """What each engine TP rank holds after ``load_weights`` of ``full`` (engine-local names).

    MoE expert stacks (``mlp.experts.w13_weight`` / ``w2_weight``) are the 3-D tensors the
    engine holds; ``ep`` is SGLang's ``--ep-size`` inside the TP group.  GLM4-MoE's correction
    bias is replicated with the router; its shared experts are a plain ``MergedColumnParallel``
    ``gate_up_proj`` + ``RowParallel`` ``down_proj`` over all ``tp`` ranks (whatever ``ep``).
    """
    h, ng, d, F = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    nq, f = h // tp, F // tp
    ranks = []
    for r in range(tp):
        if tp >= ng:
            k0, nkv = r // (tp // ng), 1  # KV head replicated over tp/ng consecutive ranks
        else:
            nkv = ng // tp
            k0 = r * nkv
        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": _engine_vocab_shard(full["model.embed_tokens.weight"], tp, r)
        }
        for n in range(spec.num_layers):
            a = f"model.layers.{n}."
            out[a + "input_layernorm.weight"] = full[a + "input_layernorm.weight"].clone()
            for suffix in ("weight", "bias") if qkv_bias(spec) else ("weight",):
                q = full[a + "self_attn.q_proj." + suffix].narrow(0, r * nq * d, nq * d)
                k = full[a + "self_attn.k_proj." + suffix].narrow(0, k0 * d, nkv * d)
                v = full[a + "self_attn.v_proj." + suffix].narrow(0, k0 * d, nkv * d)
                out[a + "self_attn.qkv_proj." + suffix] = torch.cat([q, k, v], 0)
            if qk_norm(spec):
                for x in ("q_norm", "k_norm"):
                    out[a + f"self_attn.{x}.weight"] = full[a + f"self_attn.{x}.weight"].clone()
            out[a + "self_attn.o_proj.weight"] = full[a + "self_attn.o_proj.weight"].narrow(
                1, r * nq * d, nq * d).clone()
            if POST_NORMS[spec.family]:
                out[a + POST_ATTN_NORM] = full[a + POST_ATTN_NORM].clone()
            out[a + "post_attention_layernorm.weight"] = full[a + "post_attention_layernorm.weight"].clone()
            if is_sparse(spec, n):
                # Router: ReplicatedLinear, full on every rank (§7.4); then the FusedMoE stacks.
                out[a + "mlp.gate.weight"] = full[a + "mlp.gate.weight"].clone()
                if CORRECTION_BIAS[spec.family]:
                    bias = a + "mlp.gate.e_score_correction_bias"
                    out[bias] = full[bias].clone()
                w13, w2 = sglang_fused_moe(spec, full, n, tp, ep, r)
                out[a + "mlp.experts.w13_weight"] = w13
                out[a + "mlp.experts.w2_weight"] = w2
                fs = shared_size(spec) // tp
                if fs:
                    assert shared_size(spec) % tp == 0, (shared_size(spec), tp)
                    s = a + "mlp.shared_experts."
                    gate, up = (x.narrow(0, r * fs, fs) for x in shared_gate_and_up(full, n))
                    out[s + "gate_up_proj.weight"] = torch.cat([gate, up], 0)
                    out[s + "down_proj.weight"] = full[s + "down_proj.weight"].narrow(1, r * fs, fs).clone()
                continue
            # MergedColumnParallelLinear: shard 0 (gate) then shard 1 (up), each narrowed to my rows.
            gate, up = (x.narrow(0, r * f, f) for x in gate_and_up(spec, full, n))
            out[a + "mlp.gate_up_proj.weight"] = torch.cat([gate, up], 0)
            out[a + "mlp.down_proj.weight"] = full[a + "mlp.down_proj.weight"].narrow(1, r * f, f).clone()
            if POST_NORMS[spec.family]:
                out[a + POST_MLP_NORM] = full[a + POST_MLP_NORM].clone()
        out["model.norm.weight"] = full["model.norm.weight"].clone()
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = _engine_vocab_shard(full["lm_head.weight"], tp, r)
        ranks.append(out)
    return ranks


# ---------------------------------------------------------------------------------------
# Megatron-core GPTModel: LAYOUTS.md §2-6
# ---------------------------------------------------------------------------------------

def _part(x: torch.Tensor, tp: int, r: int, dim: int) -> torch.Tensor:
    """Chunk ``r`` of ``tp`` equal chunks along ``dim`` (Megatron's ``divide`` asserts evenness)."""
    assert x.shape[dim] % tp == 0, f"{x.shape[dim]} rows do not split over tp={tp}"
    n = x.shape[dim] // tp
    return x.narrow(dim, r * n, n)


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    return _ceil_to(vocab, divisible_by * tp)


def stage_sizes(num_layers: int, pp: int, pp_layers: tuple[int, ...] | None) -> list[int]:
    if pp_layers is not None:
        assert len(pp_layers) == pp and sum(pp_layers) == num_layers
        return list(pp_layers)
    assert num_layers % pp == 0
    return [num_layers // pp] * pp


def fused_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Global fused QKV: per query group [its p q heads; its k head; its v head] (§4.1)."""
    ng, p, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape((ng, p, d) + rest), k.reshape((ng, 1, d) + rest),
                         v.reshape((ng, 1, d) + rest)], dim=1)  # [ng, p+2, d, (H)]
    return grouped.reshape((-1,) + rest)


# Local expert k's (fc1, fc2) names (LAYOUTS.md §8.1): SequentialMLP or TE grouped GEMM.
MEGATRON_EXPERTS = {
    "sequential": ("mlp.experts.local_experts.{k}.linear_fc1.weight",
                   "mlp.experts.local_experts.{k}.linear_fc2.weight"),
    "grouped": ("mlp.experts.linear_fc1.weight{k}", "mlp.experts.linear_fc2.weight{k}"),
}


def megatron_expert_rank(g: int, tp: int, dp: int, ep: int, etp: int) -> tuple[int, int, int]:
    """(edp_rank, ep_rank, etp_rank) of global rank ``g`` (LAYOUTS.md §2.4).

    The expert generator orders ``(etp, ep, edp, pp)``, ETP fastest, over the same ranks as
    the dense one; inside a stage (``tp*dp`` consecutive ranks) that is mixed radix.
    """
    within = g % (tp * dp)
    return within // (etp * ep), (within // etp) % ep, within % etp


def megatron_moe_mlp(spec: ModelSpec, full: dict[str, torch.Tensor], layer: int, local: int,
                     ep: int, etp: int, ep_rank: int, etp_rank: int,
                     expert_names: str, tp: int = 1, tp_rank: int = 0) -> dict[str, torch.Tensor]:
    """A sparse layer's MLP side on one Megatron rank (LAYOUTS.md §8.1-8.2), module order.

    ``pre_mlp_layernorm`` is always its own module (the norm cannot fuse into the router);
    the router is replicated; local expert ``k`` is global ``ep_rank*E/ep + k``, its fc1
    ``[gate_e; up_e]`` each cut to the ``etp_rank`` chunk of rows, fc2 to the chunk of down's
    columns.  SequentialMLP registers expert by expert (fc1, fc2); TEGroupedMLP registers
    its fc1 module (``weight0..``) before its fc2 module.  GLM4-MoE: the router's
    ``expert_bias`` follows its weight; ``MoELayer`` builds its shared experts after the routed
    ones, a ``SharedExpertMLP`` on the dense TP group: ``linear_fc1 [gate_r; up_r]`` over
    (``tp``, ``tp_rank``) like a dense fc1, ``linear_fc2`` the matching columns of down.
    """
    E = spec.num_experts
    assert E % ep == 0, f"{E} experts do not split over ep={ep}"
    n = E // ep
    a, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
    out = {m + "pre_mlp_layernorm.weight": full[a + "post_attention_layernorm.weight"].clone(),
           m + "mlp.router.weight": full[a + "mlp.gate.weight"].clone()}
    if CORRECTION_BIAS[spec.family]:
        out[m + "mlp.router.expert_bias"] = full[a + "mlp.gate.e_score_correction_bias"].clone()
    fc1_name, fc2_name = MEGATRON_EXPERTS[expert_names]
    fc1, fc2 = {}, {}
    for k in range(n):
        x = f"{a}mlp.experts.{ep_rank * n + k}."
        gate = _part(full[x + "gate_proj.weight"], etp, etp_rank, 0)
        up = _part(full[x + "up_proj.weight"], etp, etp_rank, 0)
        fc1[m + fc1_name.format(k=k)] = torch.cat([gate, up], 0)
        fc2[m + fc2_name.format(k=k)] = _part(full[x + "down_proj.weight"], etp, etp_rank, 1).clone()
    if expert_names == "grouped":
        out.update(fc1)
        out.update(fc2)
    else:
        for (n1, t1), (n2, t2) in zip(fc1.items(), fc2.items(), strict=True):
            out[n1], out[n2] = t1, t2
    if shared_size(spec):
        gate, up = (_part(x, tp, tp_rank, 0) for x in shared_gate_and_up(full, layer))
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[m + "mlp.shared_experts.linear_fc2.weight"] = _part(
            full[a + "mlp.shared_experts.down_proj.weight"], tp, tp_rank, 1).clone()
    return out


def _megatron_vocab_shard(w: torch.Tensor, tp: int, r: int, divisible_by: int,
                          pad_value: float) -> torch.Tensor:
    V = w.shape[0]
    Vp = megatron_padded_vocab(V, tp, divisible_by)
    pad = torch.full((Vp - V,) + tuple(w.shape[1:]), pad_value, dtype=w.dtype)
    return _part(torch.cat([w, pad], 0), tp, r, 0).clone()


def megatron_shards(
    spec: ModelSpec,
    full: dict[str, torch.Tensor],
    tp: int,
    pp: int = 1,
    pp_layers: tuple[int, ...] | None = None,
    divisible_by: int = 128,
    norm_names: str = "fused",
    dp: int = 1,
    pad_value: float = 0.0,
    ep: int = 1,
    etp: int | None = None,
    expert_names: str = "sequential",
) -> Shards:
    """Every Megatron rank's ``named_parameters`` (prefixes stripped), rank order tp-dp-pp.

    ``pad_value`` fills the vocab padding rows (Megatron initializes them; they may be
    nonzero, LAYOUTS.md §10.12), so tests can check they never reach an engine.
    MoE: ``ep``/``etp`` (default ``etp = tp``, §2.4) place the experts of sparse layers by the
    expert rank generator, so DP replicas of a stage may hold different experts.
    """
    attn_norm, mlp_norm = MEGATRON_NORMS[norm_names]
    sizes = stage_sizes(spec.num_layers, pp, pp_layers)
    starts = [sum(sizes[:s]) for s in range(pp)]
    tied = spec.tie_word_embeddings
    etp = tp if etp is None else etp
    if spec.num_experts:
        assert (tp * dp) % (etp * ep) == 0, f"etp*ep={etp * ep} does not divide tp*dp={tp * dp}"
    built: dict[tuple[int, int, int, int], dict[str, torch.Tensor]] = {}
    ranks: Shards = []
    for g in range(tp * dp * pp):
        s, r = g // (tp * dp), g % tp
        _, ep_rank, etp_rank = megatron_expert_rank(g, tp, dp, ep, etp) if spec.num_experts else (0, 0, 0)
        key = (s, r, ep_rank, etp_rank)
        if key in built:  # a DP replica holding the same shards
            ranks.append({k: t.clone() for k, t in built[key].items()})
            continue
        first, last = s == 0, s == pp - 1
        out: dict[str, torch.Tensor] = {}
        if first:
            out["embedding.word_embeddings.weight"] = _megatron_vocab_shard(
                full["model.embed_tokens.weight"], tp, r, divisible_by, pad_value)
        for local in range(sizes[s]):
            n = starts[s] + local
            a, m = f"model.layers.{n}.", f"decoder.layers.{local}."
            out[m + attn_norm] = full[a + "input_layernorm.weight"].clone()
            for suffix in ("weight", "bias") if qkv_bias(spec) else ("weight",):
                qkv = fused_qkv(spec, *(full[a + f"self_attn.{x}_proj." + suffix] for x in "qkv"))
                # Plain column-parallel split of the fused rows (Case A and Case B, §4.2).
                out[m + "self_attention.linear_qkv." + suffix] = _part(qkv, tp, r, 0).clone()
            if qk_norm(spec):
                out[m + "self_attention.q_layernorm.weight"] = full[a + "self_attn.q_norm.weight"].clone()
                out[m + "self_attention.k_layernorm.weight"] = full[a + "self_attn.k_norm.weight"].clone()
            out[m + "self_attention.linear_proj.weight"] = _part(full[a + "self_attn.o_proj.weight"], tp, r, 1).clone()
            if POST_NORMS[spec.family]:  # replicated, its own module after linear_proj
                out[m + POST_ATTN_NORM] = full[a + POST_ATTN_NORM].clone()
            if is_sparse(spec, n):
                out.update(megatron_moe_mlp(spec, full, n, local, ep, etp, ep_rank, etp_rank, expert_names,
                                            tp, r))
                continue
            out[m + mlp_norm] = full[a + "post_attention_layernorm.weight"].clone()
            gate, up = (_part(x, tp, r, 0) for x in gate_and_up(spec, full, n))
            out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)  # [gate_r; up_r] (§5)
            out[m + "mlp.linear_fc2.weight"] = _part(full[a + "mlp.down_proj.weight"], tp, r, 1).clone()
            if POST_NORMS[spec.family]:  # replicated, its own module after linear_fc2
                out[m + POST_MLP_NORM] = full[a + POST_MLP_NORM].clone()
        if last:
            out["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
            if not tied:
                out["output_layer.weight"] = _megatron_vocab_shard(
                    full["lm_head.weight"], tp, r, divisible_by, pad_value)
            elif pp > 1:
                out["output_layer.weight"] = _megatron_vocab_shard(
                    full["model.embed_tokens.weight"], tp, r, divisible_by, pad_value)
        built[key] = out
        ranks.append({k: t.clone() for k, t in out.items()})
    return ranks
