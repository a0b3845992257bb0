"""Pictures and videos as files: input images decoded and checked, output images encoded, frames
written as an MP4. Below `server/` and `cli/` so that both use the same code; nothing here knows
of HTTP, the engine or a model."""
