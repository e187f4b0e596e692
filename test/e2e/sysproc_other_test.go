//go:build unix && !linux

package e2e

import "syscall"

// sysProcAttr puts the child in its own process group, so cleanup can kill
// all of it.
func sysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
