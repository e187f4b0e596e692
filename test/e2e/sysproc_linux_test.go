//go:build linux

package e2e

import "syscall"

// sysProcAttr puts the child in its own process group (so cleanup can kill
// all of it) and has the kernel kill it if the test binary dies first (a
// test timeout skips t.Cleanup).
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
