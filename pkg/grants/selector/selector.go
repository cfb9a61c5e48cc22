package selector

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Limits of what a selector may hold.
const (
	// MaxJTILength bounds the jti of a credential id, "JTI=<jti>".
	MaxJTILength      = 128
	maxUsernameLength = 1024
)

// Check validates the wire form of a selector: a credential id of the form
// "JTI=<jti>", a username without control characters, and a cluster with
// both a namespace (an RFC 1123 label) and a name (an RFC 1123 subdomain).
// Errors wrap errdefs.ErrInvalidArgument.
func Check(s *pb.GrantSelector) error {
	var errs []string
	if id := s.GetCredentialId(); id != "" && !IsCredentialID(id) {
		errs = append(errs, fmt.Sprintf("credential id %q is not of the form JTI=<jti> (1 to %d printable ASCII characters), as 'credbroker grants list' shows it",
			Clip(id), MaxJTILength))
	}
	if u := s.GetUsername(); u != "" {
		if len(u) > maxUsernameLength || strings.ContainsFunc(u, IsControl) || strings.TrimSpace(u) != u {
			errs = append(errs, fmt.Sprintf("username %q is longer than %d bytes, or has control characters or surrounding spaces", Clip(u), maxUsernameLength))
		}
	}
	if c := s.GetCluster(); c != nil {
		switch {
		case c.GetNamespace() == "" || c.GetName() == "":
			errs = append(errs, fmt.Sprintf("cluster %q needs both a namespace and a name", Clip(c.GetNamespace()+"/"+c.GetName())))
		case len(validation.IsDNS1123Label(c.GetNamespace())) > 0:
			errs = append(errs, fmt.Sprintf("cluster namespace %q is not a valid namespace (an RFC 1123 label)", Clip(c.GetNamespace())))
		case len(validation.IsDNS1123Subdomain(c.GetName())) > 0:
			errs = append(errs, fmt.Sprintf("cluster name %q is not a valid ClusterProfile name (an RFC 1123 subdomain)", Clip(c.GetName())))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("invalid selector: %s: %w", strings.Join(errs, "; "), errdefs.ErrInvalidArgument)
	}
	return nil
}

// IsCredentialID reports whether id is a credential id of the form
// "JTI=<jti>", with 1 to MaxJTILength printable ASCII characters and no
// spaces in jti.
func IsCredentialID(id string) bool {
	jti, ok := strings.CutPrefix(id, "JTI=")
	return ok && jti != "" && len(jti) <= MaxJTILength && !strings.ContainsFunc(jti, notVisibleASCII)
}

func notVisibleASCII(r rune) bool { return r <= ' ' || r > '~' }

// IsControl reports whether r is an ASCII control character, which no
// username or reason may hold.
func IsControl(r rune) bool { return r < 0x20 || r == 0x7f }

// Clip shortens what a caller sent for messages and logs, and replaces
// anything shaped like a bearer token with its fingerprint: a caller who
// pastes a token into a field must not find it in the audit log.
func Clip(s string) string {
	if token.CheckShape(s) == nil {
		return token.Fingerprint(s)
	}
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
