"""MRoPE against transformers' own vision-language models: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5.

Each case builds the family's tiny model from a config in code (no download,
random weights) and asks the model's own ``get_rope_index`` for the positions
of a real image prompt: 3000 text tokens, ``<vision_start>``, the image's
``8 x 12`` patches merged 2 x 2 into 24 tokens, ``<vision_end>``, text. In the
image the three rows differ (time stays, height and width walk the grid);
around it they are equal. A slice of that prompt (the torch path: the image
and the tokens around it; the Triton CPU interpreter: four tokens) goes
through layer 0's attention module with the model's own rotary module
(Qwen2-VL / Qwen2.5-VL: ``Qwen2VLRotaryEmbedding`` splits the frequencies into
chunked sections, which transformers 5.x does there instead of in an
``apply_multimodal_rotary_pos_emb``; Qwen3-VL / Qwen3.5: interleaved sections,
with Qwen3-style / ``1 + w`` q/k norms, Qwen3.5 with partial rotary) and
through ``ropepool.rope_pool_fused`` with ``RopeSpec(head_dim, base,
mrope_section=..., mrope_interleaved=...)`` (built here: ``from_hf_config``
does not read MRoPE yet) and the ``[3, T]`` positions.

The comparison, its bounds and the pool checks are test_hf_norm's
(``compare_attention``): transformers' own cos is checked against the angles
recomputed with ropepool's row of each frequency, so a wrong section
assignment fails there as well as in the rotated values.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

from ropepool import RopeSpec
from tests.test_hf_norm import (
    DEVICE,
    INTERPRETER,
    compare_attention,
    randomize,
    transformers,
)
from tests.torch_fixtures import backend, rng  # noqa: F401,E402

IMAGE, VIDEO, START, END = 500, 501, 502, 503
PREFIX, GRID = 3000, (1, 8, 12)  # text before the image; the image's (t, h, w) patches, merged 2 x 2
VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 1, "intermediate_size": 32,
          "spatial_merge_size": 2, "deepstack_visual_indexes": [0]}
TEXT = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32,
        "vocab_size": 512, "max_position_embeddings": 65536}


@dataclasses.dataclass(frozen=True)
class Family:
    model: str
    config: str
    text: dict  # text_config entries beyond TEXT
    spec: RopeSpec
    norm: tuple | None  # (weight_offset, after_rope) of its q/k norm, None without one
    tf_roundings: int  # transformers' bfloat16 roundings (test_hf_norm's docstring)

    def build(self, gen):
        hidden = self.text["hidden_size"]
        cfg = getattr(transformers, self.config)(
            text_config={**TEXT, **self.text}, vision_config={**VISION, "out_hidden_size": hidden},
            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
        model = getattr(transformers, self.model)(cfg).eval()
        attn = model.language_model.layers[0].self_attn
        d = attn.head_dim
        randomize(attn, gen, [("q_proj", attn.q_proj.out_features // cfg.text_config.num_attention_heads),
                              ("k_proj", d)])
        return model, attn, model.language_model.rotary_emb


def _chunked(theta):
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": [16, 24, 24]}


FAMILIES = {
    # head_dim = hidden_size / heads = 128 for Qwen2-VL and Qwen2.5-VL
    "qwen2_vl": Family("Qwen2VLModel", "Qwen2VLConfig", {"hidden_size": 512, "rope_parameters": _chunked(1e6)},
                       RopeSpec(head_dim=128, base=1e6, mrope_section=(16, 24, 24)), None, 3),
    "qwen2_5_vl": Family("Qwen2_5_VLModel", "Qwen2_5_VLConfig",
                         {"hidden_size": 512, "rope_parameters": _chunked(1e6)},
                         RopeSpec(head_dim=128, base=1e6, mrope_section=(16, 24, 24)), None, 3),
    "qwen3_vl": Family("Qwen3VLModel", "Qwen3VLConfig", {"hidden_size": 64, "head_dim": 128, "rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
        RopeSpec(head_dim=128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True), (0.0, False), 5),
    "qwen3_5": Family("Qwen3_5Model", "Qwen3_5Config", {
        "hidden_size": 64, "head_dim": 256, "layer_types": ["full_attention"], "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
            "mrope_interleaved": True}},
        RopeSpec(head_dim=256, rotary_dim=64, base=1e7, mrope_section=(11, 11, 10), mrope_interleaved=True),
        (1.0, False), 4),
}


def image_prompt(model):
    """The model's own [3, T] positions of the prompt, and the index of its first image token."""
    merged = GRID[0] * GRID[1] * GRID[2] // 4
    ids = torch.tensor([[7] * PREFIX + [START] + [IMAGE] * merged + [END] + [7] * 3])
    positions, _ = model.get_rope_index(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(),
                                        image_grid_thw=torch.tensor([GRID]))
    return positions[:, 0], PREFIX + 1


def test_image_prompt_has_three_rows():
    """The premise: the image's rows differ from each other, the text's do not."""
    model, _, _ = FAMILIES["qwen2_vl"].build(torch.Generator().manual_seed(0))
    pos, first = image_prompt(model)
    image = pos[:, first: first + 24]
    assert not torch.equal(image[0], image[1]) and not torch.equal(image[1], image[2])
    assert image[1].unique().numel() == 4 and image[2].unique().numel() == 6  # a 4 x 6 merged grid
    assert torch.equal(pos[0, :PREFIX], pos[2, :PREFIX]) and int(pos[0, -1]) == PREFIX + 1 + 6 + 1 + 2


def _cases():
    """Every family in float32 and bfloat16; the Triton CPU interpreter takes float32 only for one family per
    section layout (its float32 path is the bfloat16 kernel without the final rounding)."""
    once = ("qwen2_vl", "qwen3_vl")
    return [pytest.param(name, dt, id=f"{name}-{dt_id}",
                         marks=pytest.mark.torch_only if dt_id == "f32" and name not in once else ())
            for name in FAMILIES for dt_id, dt in (("f32", torch.float32), ("bf16", torch.bfloat16))]


@pytest.mark.parametrize("name, dtype", _cases())
def test_matches_transformers(name, dtype, backend, rng):
    fam = FAMILIES[name]
    model, attn, rotary = fam.build(rng)
    pos, first = image_prompt(model)
    if backend == "triton" and INTERPRETER:  # text, two image tokens in different rows and columns, text
        pick = torch.tensor([first - 2, first + 7, first + 16, pos.shape[1] - 1])
    else:  # two text tokens, vision start, the image, vision end, text
        pick = torch.arange(first - 3, pos.shape[1])
    positions = pos[:, pick].to(DEVICE)
    T = len(pick)
    slots = torch.randperm(2 * T + 3, generator=rng)[:T]
    slots[::5] = -1
    attn, rotary = attn.to(DEVICE, dtype), rotary.to(DEVICE)
    hidden = torch.randn(1, T, attn.config.hidden_size, generator=rng).to(DEVICE, dtype)
    with torch.no_grad():
        emb = rotary(hidden, positions[:, None, :])
    compare_attention(attn, hidden, emb, rotary.inv_freq, rotary.attention_scaling, positions, slots.to(DEVICE),
                      fam.spec, norm=fam.norm, tf_roundings=fam.tf_roundings, backend=backend, gen=rng)
