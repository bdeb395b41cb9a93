"""The decoding engine: the round over one slot pool, its admission, slots, drafters, sampling and constraints."""
