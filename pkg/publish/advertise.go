package publish

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/types"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/internal/serverurl"
)

// The kinds of conflict between what agents advertise and what is
// published.
const (
	// conflictAgents: live agents advertise different servers or CAs, and
	// nothing is published yet.
	conflictAgents = "agents disagree"
	// conflictPinned: an entry is published, and the agents advertise
	// another server or CA, or disagree among themselves.
	conflictPinned = "agents disagree with the published entry"
	// conflictRefused: an agent advertises a server that is never
	// published (not an https URL with a host).
	conflictRefused = "advertised server is not an https URL"
)

// maxLoggedURL bounds an advertised server in a log line: it comes from
// an agent.
const maxLoggedURL = 256

// ValidServer reports whether server may be published or pinned: what
// serverurl.Check accepts (an absolute https URL, scheme case aside, with a
// host, and without user info, query or fragment), the rule by which the
// broker serves a server, so that every entry the broker serves is pinned.
func ValidServer(server string) bool {
	return serverurl.Valid(server)
}

// verdict is what the published entry and the agents' advertisements
// decide about one ClusterProfile.
type verdict struct {
	// server and caData are the server and CA to publish; server is empty
	// when nothing is to be published.
	server     string
	caData     []byte
	extensions []clientcmdv1.NamedExtension
	// conflict is the kind of conflict, empty when there is none.
	conflict string
}

// decide applies the rule that no agent picks where consumers send tokens:
//   - only an https URL with a host is ever taken, from an agent or from
//     the status;
//   - a valid entry in the status (the publisher's own, or one an admin
//     wrote) is pinned: it stays whatever the agents advertise, until an
//     admin removes it;
//   - without one, a server is published only when every live stream that
//     advertises one advertises the same server and CA.
func decide(pinned *v1alpha1.AccessProvider, ads []Advertisement) verdict {
	var valid []Advertisement
	refused := false
	for _, a := range ads {
		if ValidServer(a.Server) {
			valid = append(valid, a)
		} else {
			refused = true
		}
	}
	var v verdict
	switch {
	case pinned != nil && ValidServer(pinned.Cluster.Server):
		v.server, v.caData, v.extensions = pinned.Cluster.Server, pinned.Cluster.CertificateAuthorityData, extraExtensions(pinned)
		if len(valid) > 1 || (len(valid) == 1 &&
			(valid[0].Server != v.server || !bytes.Equal(valid[0].CAData, v.caData) || !sameExtensions(valid[0].Extensions, v.extensions))) {
			v.conflict = conflictPinned
		}
	case len(valid) == 1:
		v.server, v.caData, v.extensions = valid[0].Server, valid[0].CAData, valid[0].Extensions
	case len(valid) > 1:
		v.conflict = conflictAgents
	}
	if v.conflict == "" && refused {
		v.conflict = conflictRefused
	}
	return v
}

// noteConflict records v's conflict for key, logs it when it is new or
// changed, and logs its end.
func (p *Publisher) noteConflict(key types.NamespacedName, v verdict, ads []Advertisement) {
	var desc string
	var advertised []string
	if v.conflict != "" {
		for _, a := range ads {
			advertised = append(advertised, describe(a.Server, a.CAData)+fmt.Sprintf(" streams=%d", a.Streams))
		}
		desc = v.conflict + "|" + describe(v.server, v.caData) + "|" + strings.Join(advertised, ",")
	}
	p.mu.Lock()
	last, had := p.conflicts[key]
	if desc == "" {
		delete(p.conflicts, key)
	} else {
		p.conflicts[key] = desc
	}
	p.mu.Unlock()
	switch {
	case desc != "" && desc != last:
		published := ""
		if v.server != "" {
			published = describe(v.server, v.caData)
		}
		p.cfg.Log.Info("agents' advertised servers are in conflict", "cluster", key.String(), "conflict", v.conflict,
			"published", published, "advertised", advertised)
	case desc == "" && had:
		p.cfg.Log.Info("agents' advertised servers no longer conflict", "cluster", key.String())
	}
}

// Conflicts reports how many ClusterProfiles have advertisements in
// conflict, as the publisher last saw them; 0 while it does not run.
func (p *Publisher) Conflicts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conflicts)
}

// describe names a server and CA in a log line: the server clipped, the CA
// by the first bytes of its SHA-256.
func describe(server string, caData []byte) string {
	sum := sha256.Sum256(caData)
	return clipURL(server) + " ca=" + hex.EncodeToString(sum[:6])
}

// clipURL is s, without a password, quoted and clipped for a log line.
func clipURL(s string) string {
	s = serverurl.Redacted(s)
	if len(s) <= maxLoggedURL {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q…(%d bytes)", s[:maxLoggedURL], len(s))
}
