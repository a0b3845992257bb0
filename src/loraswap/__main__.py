from loraswap.cli import app

app(prog_name="loraswap")
