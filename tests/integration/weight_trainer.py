"""A trainer process for the weight-update tests: loads a Hugging Face model, perturbs its weights
per round (seeded), saves each round's model for the reference, and sends it to the engine with
`vllm_gaudi_platform.distributed.weight_sender` (the client a training script uses).

    python weight_trainer.py '<json job>'

Job keys: model (path), init_info (HpuWeightSender's arguments: master_address, master_port,
world_size, timeout_s), rounds (list of {seed, scale, bucket_bytes, save (a directory, or
null), die_after_buckets (null, or: send that many buckets and exit at once, mid-round)}).
"""

from __future__ import annotations

import json
import os
import sys


def perturbed(model, seed: int, scale: float) -> None:
    """Every weight moves by `scale` times its own spread, in place (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            spread = float(param.float().std()) if param.numel() > 1 else 1.0
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.add_((noise * scale * (spread or 1.0)).to(param.dtype))


def main(job: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_gaudi_platform.distributed.weight_sender import HpuWeightSender

    original = AutoModelForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32)
    info = job["init_info"]
    sender = HpuWeightSender(
        info["master_address"],
        info["master_port"],
        info["world_size"],
        timeout_s=info["timeout_s"],
    )
    sender.connect()
    print("TRAINER connected", flush=True)
    for spec in job["rounds"]:
        model = AutoModelForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32)
        model.load_state_dict(original.state_dict())
        perturbed(model, spec["seed"], spec["scale"])
        if spec.get("save"):
            model.save_pretrained(spec["save"])
        sender.bucket_bytes = spec["bucket_bytes"]
        plan = sender.send(
            model.named_parameters(), stop_after_buckets=spec.get("die_after_buckets")
        )
        if spec.get("die_after_buckets") is not None:
            print(f"TRAINER dies mid-round after {spec['die_after_buckets']} buckets", flush=True)
            os._exit(3)
        print(f"TRAINER sent {len(plan.params)} tensors in {len(plan.buckets)} buckets", flush=True)
    sender.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
