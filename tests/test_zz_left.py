import subprocess, sys, time, os
PID = []
def test_leaves_a_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    PID.append(p.pid)
def test_it_is_gone():
    time.sleep(0.5)
    os.waitpid(PID[0], os.WNOHANG)
    assert not os.path.exists(f"/proc/{PID[0]}") or open(f"/proc/{PID[0]}/stat").read().split()[2] == "Z"
def test_hang_times_out():
    time.sleep(1000)
