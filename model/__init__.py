"""The reference 3D U-Net and its loss."""

from model.loss import Loss
from model.unet import UNet, UNetSpec

__all__ = ["Loss", "UNet", "UNetSpec"]
