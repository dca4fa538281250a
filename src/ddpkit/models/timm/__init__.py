"""timm's models (`model.arch=timm:NAME`): their card (keys.py, torch-free) and their family (model.py; timm is
imported only when such a model is asked for)."""
