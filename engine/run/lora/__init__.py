"""LoRA adapters per request, the compute side: PEFT directories read and checked (adapter.py),
held in bounded slots (slots.py), their low-rank deltas added per row (layers.py). The
scheduler's cap on adapters per step is engine/sched/lora.py.
"""
