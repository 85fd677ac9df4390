"""Small backbones shared by several notebooks."""
