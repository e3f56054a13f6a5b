from pipeline.runtime.hosting.launcher import follow_launcher

follow_launcher()  # a job started by the launcher sets up its signals first (runtime/hosting/launcher.py)

from pipeline.cli import main  # noqa: E402 - after the signals

main()
