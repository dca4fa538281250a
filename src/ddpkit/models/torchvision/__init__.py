"""torchvision's classification models (`model.arch=resnet18`, ...): their card (keys.py, torch-free) and their
family with the pretrained weights (model.py; torchvision is imported only when such a model is asked for)."""
