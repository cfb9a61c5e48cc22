package faultproxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// Proxy forwards every connection made to Addr to its target.
type Proxy struct {
	target string
	lis    net.Listener

	mu sync.Mutex
	// healed is closed while bytes flow; a Partition replaces it with an
	// open channel that Heal closes.
	healed chan struct{}
	down   bool
	closed bool
	conns  map[*net.TCPConn]struct{}
	wg     sync.WaitGroup
}

// New listens on a free loopback port and forwards to target (host:port).
func New(target string) (*Proxy, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: %w", err)
	}
	p := &Proxy{target: target, lis: lis, healed: make(chan struct{}), conns: map[*net.TCPConn]struct{}{}}
	close(p.healed)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.lis.Addr().String() }

// Partition stops forwarding bytes, in both directions and on every
// connection, new ones included; TCP connections stay open.
func (p *Proxy) Partition() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.healed:
		p.healed = make(chan struct{})
	default:
	}
}

// Down resets every open connection and every new one until Heal.
func (p *Proxy) Down() {
	p.mu.Lock()
	p.down = true
	conns := p.takeConns()
	p.mu.Unlock()
	for _, c := range conns {
		reset(c)
	}
}

// Heal ends a Partition or a Down: bytes flow again and new connections
// are forwarded.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = false
	select {
	case <-p.healed:
	default:
		close(p.healed)
	}
}

// Conns is the number of connections open through the proxy, counting each
// side once.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) / 2
}

// Close stops the proxy and resets every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	conns := p.takeConns()
	if p.healed != nil {
		select {
		case <-p.healed:
		default:
			close(p.healed)
		}
	}
	p.mu.Unlock()
	err := p.lis.Close()
	for _, c := range conns {
		reset(c)
	}
	p.wg.Wait()
	return err
}

// takeConns empties the connection set; p.mu must be held.
func (p *Proxy) takeConns() []*net.TCPConn {
	conns := make([]*net.TCPConn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	clear(p.conns)
	return conns
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.serve(c.(*net.TCPConn))
		}()
	}
}

func (p *Proxy) serve(client *net.TCPConn) {
	p.mu.Lock()
	refuse := p.down || p.closed
	p.mu.Unlock()
	if refuse {
		reset(client)
		return
	}
	c, err := net.Dial("tcp", p.target)
	if err != nil {
		reset(client)
		return
	}
	server := c.(*net.TCPConn)
	if !p.track(client, server) {
		reset(client)
		reset(server)
		return
	}
	var pumps sync.WaitGroup
	pumps.Go(func() { p.pump(server, client) })
	pumps.Go(func() { p.pump(client, server) })
	pumps.Wait()
	p.untrack(client, server)
}

// track adds both sides of a connection unless the proxy went down or
// closed meanwhile.
func (p *Proxy) track(conns ...*net.TCPConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down || p.closed {
		return false
	}
	for _, c := range conns {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(conns ...*net.TCPConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range conns {
		delete(p.conns, c)
	}
}

// pump copies src to dst, waiting before each write while the proxy is
// partitioned. When src ends, it half-closes dst; when either fails, it
// resets both.
func (p *Proxy) pump(dst, src *net.TCPConn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			healed := p.healed
			p.mu.Unlock()
			<-healed
			if _, werr := dst.Write(buf[:n]); werr != nil {
				reset(src)
				reset(dst)
				return
			}
		}
		if errors.Is(err, io.EOF) {
			_ = dst.CloseWrite()
			return
		}
		if err != nil {
			reset(src)
			reset(dst)
			return
		}
	}
}

// reset closes c with a TCP reset rather than a clean close.
func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	_ = c.Close()
}
