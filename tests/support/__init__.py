"""What tests share: real servers and ports (`servers`), a backend with no engine (`fakes`),
numeric checks (`numerics`), the shape classifier of the demo model's pictures (`shapes`), hostile
safetensors headers and what reading them costs (`headers`)."""
