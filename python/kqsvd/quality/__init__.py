"""What a rank costs the model, and ranks and up-projections fitted to it:
the KL to the full model (kl.py), the quality measure (measure.py),
quality-aware ranks (allocate.py) and tuned up-projections (tune.py).
`python -m kqsvd.quality` runs the command (kqsvd.commands.quality)."""
