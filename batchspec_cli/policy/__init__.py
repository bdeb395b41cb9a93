"""Pure choices in plain Python, no torch: which drafter and k (control), which group (grouping), model-free drafts
(lookup)."""
