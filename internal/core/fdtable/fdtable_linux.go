package fdtable

import (
	"fmt"
	"os"
	"syscall"
)

// Reserve grows the descriptor table to hold at least n descriptors, or
// as many as RLIMIT_NOFILE allows when that is fewer. It opens no
// descriptor that outlives the call and never touches one in use.
func Reserve(n int) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("fdtable: getrlimit: %w", err)
	}
	if uint64(n) > lim.Cur {
		n = int(lim.Cur)
	}
	if n <= 0 {
		return nil
	}
	f, err := os.Open(os.DevNull)
	if err != nil {
		return fmt.Errorf("fdtable: %w", err)
	}
	defer f.Close()
	// F_DUPFD takes the lowest free descriptor >= n-1: it grows the table
	// to cover n-1 and, unlike dup2, cannot close a descriptor in use.
	raw, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("fdtable: %w", err)
	}
	var dup uintptr
	var errno syscall.Errno
	if err := raw.Control(func(fd uintptr) {
		dup, _, errno = syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_DUPFD_CLOEXEC, uintptr(n-1))
	}); err != nil {
		return fmt.Errorf("fdtable: %w", err)
	}
	if errno != 0 {
		return fmt.Errorf("fdtable: reserve %d descriptors: %w", n, errno)
	}
	return syscall.Close(int(dup))
}
