"""The built-in small classifiers (`model.arch=cnn`, `mlp`): their card (keys.py, torch-free) and the models and
their family (model.py)."""
