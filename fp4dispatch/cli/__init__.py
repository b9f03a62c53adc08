"""``python -m fp4dispatch.tune`` and what only it needs: model presets, multi-GPU runs, profiles."""
