"""The reference 3D U-Net and its loss."""

from model.loss import unet_loss
from model.unet import UNet

__all__ = ["UNet", "unet_loss"]
