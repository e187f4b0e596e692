package main

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"

	"golang.org/x/net/dns/dnsmessage"
)

// hostIPs are this host's addresses a peer could dial: every interface
// address but loopback and link-local ones, IPv4 first.
func hostIPs() ([]net.IP, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	var v4, v6 []net.IP
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok || n.IP.IsLoopback() || n.IP.IsLinkLocalUnicast() || n.IP.IsUnspecified() {
			continue
		}
		if n.IP.To4() != nil {
			v4 = append(v4, n.IP)
		} else {
			v6 = append(v6, n.IP)
		}
	}
	return append(v4, v6...), nil
}

// nameservers are the nameserver addresses (host:53) of a resolv.conf.
func nameservers(path string) []string {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "nameserver" && net.ParseIP(f[1]) != nil {
			out = append(out, net.JoinHostPort(f[1], "53"))
		}
	}
	return out
}

// reverseName is the name DNS gives the first of ips that has one: a
// reverse (PTR) query to servers, checked by a forward lookup through r
// that must lead back to the same address. The query goes to the
// nameservers themselves: the system's lookup would read /etc/hosts
// first, where Docker names a container only by its id. Of a name with
// several labels, the first label alone is taken when it resolves to that
// address too: Docker's DNS names a compose container
// "<container>.<network>" (troupe_thinker_2.troupe_default) and resolves
// "<container>" on its network, which is the name `docker ps` and
// `docker-compose ps` show. "" when no address has a name that checks.
func reverseName(ctx context.Context, servers []string, r *net.Resolver, ips []net.IP) string {
	for _, ip := range ips {
		for _, name := range ptrNames(ctx, servers, ip) {
			name = strings.TrimSuffix(name, ".")
			if name == "" {
				continue
			}
			candidates := []string{name}
			if short, _, ok := strings.Cut(name, "."); ok && short != "" {
				candidates = []string{short, name}
			}
			for _, c := range candidates {
				if resolvesTo(ctx, r, c, ip) {
					return c
				}
			}
		}
	}
	return ""
}

// ptrNames asks each server in turn for ip's PTR records, over UDP; the
// first that answers decides.
func ptrNames(ctx context.Context, servers []string, ip net.IP) []string {
	arpa, err := reverseArpa(ip)
	if err != nil {
		return nil
	}
	for _, s := range servers {
		names, err := queryPTR(ctx, s, arpa)
		if err == nil {
			return names
		}
	}
	return nil
}

// reverseArpa is ip's name under in-addr.arpa or ip6.arpa.
func reverseArpa(ip net.IP) (dnsmessage.Name, error) {
	if v4 := ip.To4(); v4 != nil {
		return dnsmessage.NewName(fmtV4(v4) + "in-addr.arpa.")
	}
	var b strings.Builder
	const hex = "0123456789abcdef"
	v6 := ip.To16()
	if v6 == nil {
		return dnsmessage.Name{}, errors.New("not an IP address")
	}
	for i := len(v6) - 1; i >= 0; i-- {
		b.WriteByte(hex[v6[i]&0xf])
		b.WriteByte('.')
		b.WriteByte(hex[v6[i]>>4])
		b.WriteByte('.')
	}
	return dnsmessage.NewName(b.String() + "ip6.arpa.")
}

// fmtV4 is "d.c.b.a." of the IPv4 address a.b.c.d.
func fmtV4(v4 net.IP) string {
	parts := strings.Split(v4.String(), ".")
	slices.Reverse(parts)
	return strings.Join(parts, ".") + "."
}

// queryPTR sends one PTR query for name to server and returns the answer's
// names (none for NXDOMAIN).
func queryPTR(ctx context.Context, server string, name dnsmessage.Name) ([]string, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "udp", server)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	id := uint16(os.Getpid())
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: id, RecursionDesired: true})
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(dnsmessage.Question{Name: name, Type: dnsmessage.TypePTR, Class: dnsmessage.ClassINET}); err != nil {
		return nil, err
	}
	msg, err := b.Finish()
	if err != nil {
		return nil, err
	}
	if _, err := conn.Write(msg); err != nil {
		return nil, err
	}
	buf := make([]byte, 1500)
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return nil, err
		}
		var p dnsmessage.Parser
		h, err := p.Start(buf[:n])
		if err != nil || h.ID != id || !h.Response {
			continue // not our answer
		}
		switch h.RCode {
		case dnsmessage.RCodeSuccess:
		case dnsmessage.RCodeNameError:
			return nil, nil
		default:
			return nil, errors.New("PTR query: " + h.RCode.String())
		}
		if err := p.SkipAllQuestions(); err != nil {
			return nil, err
		}
		var names []string
		for {
			ah, err := p.AnswerHeader()
			if errors.Is(err, dnsmessage.ErrSectionDone) {
				return names, nil
			}
			if err != nil {
				return nil, err
			}
			if ah.Type != dnsmessage.TypePTR {
				if err := p.SkipAnswer(); err != nil {
					return nil, err
				}
				continue
			}
			ptr, err := p.PTRResource()
			if err != nil {
				return nil, err
			}
			names = append(names, ptr.PTR.String())
		}
	}
}

// resolvesTo reports whether host's addresses include ip.
func resolvesTo(ctx context.Context, r *net.Resolver, host string, ip net.IP) bool {
	addrs, err := r.LookupIPAddr(ctx, host)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(addrs, func(a net.IPAddr) bool { return a.IP.Equal(ip) })
}
