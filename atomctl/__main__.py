from atomctl.main import app

app()
