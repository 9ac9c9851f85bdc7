"""Cost model (BlendServe Sec. 4.1): shapes from HF configs, formulas, vectorisation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixflow.pipeline.cost_model import (
    HARDWARE,
    LLAMA3_8B,
    CostModel,
    HardwareProfile,
    ModelShape,
    get_hardware,
    measure_cpu_profile,
)

LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_shape_from_hf_config_dict_file_and_directory(tmp_path):
    assert ModelShape.from_hf_config(LLAMA3_8B_CONFIG) == LLAMA3_8B
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    assert ModelShape.from_hf_config(tmp_path) == LLAMA3_8B
    assert ModelShape.from_hf_config(str(tmp_path / "config.json")) == LLAMA3_8B
    fp32_mha = dict(LLAMA3_8B_CONFIG, torch_dtype="float32")
    del fp32_mha["num_key_value_heads"]
    shape = ModelShape.from_hf_config(fp32_mha)
    assert shape.num_kv_heads == 32 and shape.dtype_bytes == 4 and shape.head_dim == 128


def test_llama3_8b_parameter_count_and_kv_bytes():
    total = (LLAMA3_8B.weight_bytes) / LLAMA3_8B.dtype_bytes
    assert total == pytest.approx(8.03e9, rel=0.01)  # the published 8.03B parameters
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 kv heads


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": 8}, "num_hidden_layers"),
        (dict(LLAMA3_8B_CONFIG, num_key_value_heads=5), "num_kv_heads=5"),
        (dict(LLAMA3_8B_CONFIG, num_hidden_layers=0), "num_layers=0"),
    ],
)
def test_bad_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(config)


def test_formulas_match_the_paper_by_hand():
    hw = HardwareProfile("test", peak_flops=1e15, mem_bandwidth=1e12, memory_bytes=80e9)
    cm = CostModel(LLAMA3_8B, hw)
    p, d, s = 1000, 50, 200
    m = LLAMA3_8B
    gemm = 2 * m.layer_params * ((p - s) + d) + 2 * m.hidden_size * m.vocab_size * d
    attn = 2 * m.num_layers * m.num_heads * m.head_dim * (p**2 - s**2)
    assert cm.compute_seconds(p, d, s) == pytest.approx((gemm + attn) / 1e15)
    read = sum(p + i for i in range(1, d + 1)) * m.kv_bytes_per_token
    assert cm.memory_seconds(p, d) == pytest.approx(read / 1e12)
    cost = cm.predict(np.array([p]), np.array([d]), np.array([s]))
    assert cost.kv_bytes[0] == (p + d) * m.kv_bytes_per_token
    assert cost.density[0] == pytest.approx(cost.compute_s[0] / cost.memory_s[0])


def test_vectorised_and_monotone_like_figure_4():
    cm = CostModel.create(None, "a100")
    prompts = np.array([200, 200, 200, 2000])
    outputs = np.array([10, 100, 1000, 100])
    cost = cm.predict(prompts, outputs)
    assert cost.compute_s.shape == cost.memory_s.shape == cost.density.shape == (4,)
    # Density falls quickly with output length (Fig. 4); prompts cost compute and memory alike.
    assert cost.density[0] > 5 * cost.density[1] > 25 * cost.density[2]
    assert cost.compute_s[3] > cost.compute_s[1] and cost.memory_s[3] > cost.memory_s[1]
    # A cached prefix saves compute, never memory traffic (Sec. 3.3).
    cached = cm.predict(prompts, outputs, prompts // 2)
    assert np.all(cached.compute_s < cost.compute_s)
    np.testing.assert_array_equal(cached.memory_s, cost.memory_s)


def test_hardware_profiles_and_measured_cpu():
    assert get_hardware("h200").mem_bandwidth > get_hardware("h100").mem_bandwidth
    assert set(HARDWARE) == {"h100", "h200", "a100"}
    cpu = measure_cpu_profile(matmul_size=64, copy_mib=1, repeats=1)
    assert cpu.peak_flops > 0 and cpu.mem_bandwidth > 0 and cpu.name == "cpu"
    assert CostModel(LLAMA3_8B, HARDWARE["h100"]).kv_budget_bytes > 0
    with pytest.raises(ValueError, match="hardware='tpu'"):
        get_hardware("tpu")


def test_policy_modules_import_no_torch_or_ray():
    import subprocess
    import sys

    modules = ["cost_model", "blendserve", "partition"]
    code = (
        "import sys\n"
        + "".join(f"import prefixflow.pipeline.{m}\n" for m in modules)
        + "print(','.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
