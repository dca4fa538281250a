"""A one-device training script, the way people write it before going distributed: their own data set, model,
optimizer, loss and DataLoader (workers, collate_fn, pin_memory), a validation pass, the weights saved at the end.

    python single_gpu.py --epochs 3 --out model.pt
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Blobs(Dataset):
    """Ten Gaussian blobs in 20 dimensions: a small, learnable classification set."""

    def __init__(self, size, seed):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(10, 20, generator=torch.Generator().manual_seed(99)) * 2
        self.y = torch.randint(0, 10, (size,), generator=g)
        self.x = centers[self.y] + torch.randn(size, 20, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.tensor(ys)


def build_model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    train_loader = DataLoader(Blobs(1000, 1), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, persistent_workers=args.workers > 0)
    val_loader = DataLoader(Blobs(333, 2), batch_size=64, shuffle=False, collate_fn=collate)
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
                total += len(y)
        print(f"epoch {epoch} | loss {loss.item():.4f} | val acc {correct / total:.4f} on {total} samples", flush=True)
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--out", default="model.pt")
    main(parser.parse_args())
