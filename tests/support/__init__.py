"""What tests share: real servers and ports (`servers`), a backend with no engine (`fakes`),
numeric checks (`numerics`), the shape classifier of the demo model's pictures (`shapes`),
`demo-flux`'s fixed prompts and what its pictures are scored on (`demo_flux_scores`), hostile
safetensors headers and what reading them costs (`headers`), the examples of a docs page
run against real servers (`docs`), a file's digests taken from all of its bytes (`file_hashes`)."""
