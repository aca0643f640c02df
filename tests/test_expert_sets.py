"""Layers with several expert sets (ERNIE-4.5-VL: text experts and vision experts, chosen per token by a
token-type mask), served by ``attach`` from a pool per set, against PEFT.

A tiny ERNIE-4.5-VL text stack whose two sets differ in I (as the real model's 1536 and 512 do) gets three
PEFT adapters: one on both sets, one on the text experts only, one on the vision gate/up only. One
left-padded batch mixes them with a row of no adapter, with vision tokens in three of the four rows (one
of them the text-only adapter's, whose vision tokens then run the base vision experts): every row's hidden
states must equal PEFT's model of that row's adapter run on the row alone.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peft_oracle import fill_lora, left_padded, rel_err  # noqa: E402

from moelora.integrations import MoELoRAExperts, attach  # noqa: E402
from moelora.peft_loader import OTHER_EXPERT_SET, AdapterLoadError  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
if not hasattr(transformers, "Ernie4_5_VLMoeTextModel"):
    pytest.skip("this transformers has no ERNIE-4.5-VL", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys did not match",
    "ignore::UserWarning:transformers",
)

TEXT, VISION = "mlp.text_moe.experts", "mlp.vision_moe.experts"
ADAPTERS = {
    "both": dict(r=4, lora_alpha=8, target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
    "text": dict(r=2, lora_alpha=4, target_parameters=["text_moe.experts.gate_up_proj",
                                                      "text_moe.experts.down_proj"]),
    "vision": dict(r=8, lora_alpha=8, use_rslora=True, target_parameters=["vision_moe.experts.gate_up_proj"]),
}
ROWS = ["both", "text", None, "vision"]
ROW_LENS = [6, 4, 6, 5]  # left padded to 6
VISION_TOKENS = [(1, 3), (3, 5), (0, 0), (2, 6)]  # [start, end) of each row's vision tokens
REL_TOL = {"cpu": 1e-4, "cuda": 1e-3}  # fp32 on CUDA: the Triton kernels against PEFT's CUDA forward


def _model(vision_inter: int = 16) -> torch.nn.Module:
    # I differs per set (24 text, 16 vision) and from H; 8 experts, top-2 (experts no token picks); layer
    # 0 dense, layers 1-2 MoE with a shared expert.
    cfg = transformers.Ernie4_5_VLMoeTextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
        moe_intermediate_size=[24, vision_inter], moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
        max_position_embeddings=64, pad_token_id=0,
        rope_parameters=dict(rope_theta=500000.0, rope_type="default", mrope_section=[1, 1, 2]))
    torch.manual_seed(0)
    model = transformers.Ernie4_5_VLMoeTextModel(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # sharper routing than the init, so tokens pick different experts
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _inputs(device: str):
    ids, mask = left_padded(ROW_LENS, 96)
    token_types = torch.zeros_like(ids)
    for row, (start, end) in enumerate(VISION_TOKENS):
        token_types[row, start:end] = 1
    return ids.to(device), mask.to(device), token_types.to(device)


def _save_adapters(model: torch.nn.Module, root: Path) -> dict:
    oracles = {None: model}
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(target_modules=[], **cfg))
        fill_lora(pm, seed=100 + seed)
        pm.eval().save_pretrained(str(root / name))
        oracles[name] = pm
    return oracles


def _check_served(device: str, tmp_path: Path) -> None:
    model = _model().to(device)
    oracles = _save_adapters(model, tmp_path)
    ids, mask, token_types = _inputs(device)
    tol = REL_TOL[device]
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=mask, moe_mm_token_type_ids=token_types).last_hidden_state
    keys_before = list(model.state_dict())

    handle = attach(model, max_loras=3, max_rank=8, path="torch" if device == "cpu" else "auto")
    try:
        assert list(handle.pools) == [TEXT, VISION]
        assert [p.intermediate_size for p in handle.pools.values()] == [24, 16]
        assert handle.pool is handle.pools[TEXT] and handle.layer_ids == (1, 2)
        swapped = [m for mods in handle.expert_sets.values() for m in mods.values()]
        assert len(swapped) == 4 and all(isinstance(m, MoELoRAExperts) for m in swapped)
        assert list(model.state_dict()) == keys_before
        reports = {name: handle.load_adapter(name, tmp_path / name) for name in ADAPTERS}
        assert {name: sorted(r) for name, r in reports.items()} == {
            "both": [TEXT, VISION], "text": [TEXT], "vision": [VISION]}
        assert [sorted(p.adapters()) for p in handle.pools.values()] == [["both", "text"], ["both", "vision"]]
        # each pool leaves the other set's LoRA to that set's pool, and says so
        for set_name, other in ((TEXT, "vision_moe"), (VISION, "text_moe")):
            ignored = reports["both"][set_name].ignored_keys
            assert ignored and all(other in key and why.startswith(OTHER_EXPERT_SET)
                                   for key, why in ignored.items())

        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, attention_mask=mask,
                                     moe_mm_token_type_ids=token_types).last_hidden_state, base)
            with handle.adapters(ROWS):
                got = model(input_ids=ids, attention_mask=mask,
                            moe_mm_token_type_ids=token_types).last_hidden_state
                text_only = model(input_ids=ids, attention_mask=mask).last_hidden_state  # no vision tokens
            for row, name in enumerate(ROWS):
                real, one = slice(max(ROW_LENS) - ROW_LENS[row], None), slice(row, row + 1)
                want = oracles[name](input_ids=ids[one], attention_mask=mask[one],
                                     moe_mm_token_type_ids=token_types[one]).last_hidden_state[0, real]
                assert rel_err(got[row, real], want) < tol, (name, rel_err(got[row, real], want))
                if name is not None:  # the adapter changes this row
                    assert rel_err(base[row, real], want) > 1e-2, name
                want = oracles[name](input_ids=ids[one], attention_mask=mask[one]).last_hidden_state[0, real]
                assert rel_err(text_only[row, real], want) < tol, name

        handle.pools[VISION].pin("both")
        with pytest.raises(ValueError, match="pinned"):
            handle.unload_adapter("both")
        assert all("both" in pool for pool in handle.pools.values())  # neither pool let it go
        handle.pools[VISION].unpin("both")
        handle.unload_adapter("both")
        assert [sorted(p.adapters()) for p in handle.pools.values()] == [["text"], ["vision"]]
    finally:
        handle.detach()
    assert not any(isinstance(m, MoELoRAExperts) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask,
                                 moe_mm_token_type_ids=token_types).last_hidden_state, base)


def test_expert_sets_match_peft(tmp_path):
    _check_served("cpu", tmp_path)


@pytest.mark.gpu
def test_expert_sets_on_cuda_match_peft(tmp_path):
    _check_served("cuda", tmp_path)


def test_a_failed_load_leaves_every_pool_as_it_was(tmp_path):
    """An adapter whose vision LoRA does not fit (trained with another vision I): the text pool's load,
    done first, is undone; nothing of the adapter is left in either pool."""
    pm = peft.get_peft_model(_model(vision_inter=8), peft.LoraConfig(target_modules=[], **ADAPTERS["both"]))
    pm.save_pretrained(str(tmp_path / "other_vision_i"))
    model = _model()
    peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(target_modules=[], **ADAPTERS["text"])
                        ).save_pretrained(str(tmp_path / "text"))
    with attach(model, max_loras=2, max_rank=8, path="torch") as handle:
        with pytest.raises(AdapterLoadError, match="lora_B"):
            handle.load_adapter("bad", tmp_path / "other_vision_i")
        assert all("bad" not in pool for pool in handle.pools.values())
        with pytest.raises(ValueError, match="unknown adapter"):
            with handle.adapters(["bad"]):
                pass
        # in the background: the same loads, the same undoing
        assert isinstance(handle.load_adapter_async("bad", tmp_path / "other_vision_i").exception(),
                          AdapterLoadError)
        assert all("bad" not in pool for pool in handle.pools.values())
        handle.load_adapter_async("text", tmp_path / "text").result()
        assert ["text" in pool for pool in handle.pools.values()] == [True, False]
    with pytest.raises(ValueError, match="give no pool"):
        attach(model, pool=handle.pool)
