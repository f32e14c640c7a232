"""LoRA adapters per request: PEFT directories read and checked (adapter.py), held in bounded
slots (slots.py), their low-rank deltas added per row (layers.py), admission capped (admission.py).
"""
