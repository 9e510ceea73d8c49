"""pytorchexample: A Flower / PyTorch app."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()  # noqa: UP008 (the official example's line)
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


# --- Local data instead of CIFAR-10 from the Hugging Face Hub (the one change; see ../README.md) ---------------
# scikit-learn's digits (1,797 8x8 images, in the wheel: no download), made CIFAR-shaped for the unchanged Net:
# upsampled to 32x32, three channels, normalised as ToTensor() + Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)).
# A "train" split (80 %) is partitioned IID as FederatedDataset(..., partitioners={"train": IidPartitioner(n)})
# does (shuffled with seed 42, contiguous shards), each partition split 80/20 with seed 42; the "test" split is the
# centralized test set.

splits = None  # Cache the two splits, as the example caches its FederatedDataset


class ImageDataset(Dataset):
    """Rows of {"img": 3x32x32 tensor, "label": int}, the batches the example's train and test read."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"img": self.images[index], "label": int(self.labels[index])}


def _load_splits():
    global splits
    if splits is None:
        digits = load_digits()
        images = torch.as_tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
        images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
        images = (images - 0.5) / 0.5
        order = np.random.RandomState(42).permutation(len(images))
        cut = int(0.8 * len(order))
        splits = {"train": (images[order[:cut]], digits.target[order[:cut]]),
                  "test": (images[order[cut:]], digits.target[order[cut:]])}
    return splits


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition of the digits "train" split."""
    images, labels = _load_splits()["train"]
    shard = np.array_split(np.random.RandomState(42).permutation(len(labels)), num_partitions)[partition_id]
    # Divide data on each node: 80% train, 20% test
    shuffled = shard[np.random.RandomState(42).permutation(len(shard))]
    cut = len(shuffled) - int(np.ceil(0.2 * len(shuffled)))
    train, test = shuffled[:cut], shuffled[cut:]
    # Construct dataloaders
    trainloader = DataLoader(ImageDataset(images[train], labels[train]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(ImageDataset(images[test], labels[test]), batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    images, labels = _load_splits()["test"]
    return DataLoader(ImageDataset(images, labels), batch_size=128)


# --- Unchanged from here -----------------------------------------------------------------------------------------


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
