package tokenexchange

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/errdefs"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Bounds on a request's audiences.
const (
	maxAudiences      = 16
	maxAudienceLength = 256
)

// request is a validated ExchangeRequest.
type request struct {
	cluster        types.NamespacedName
	serviceAccount types.NamespacedName // zero when the agent should pick
	audiences      []string             // sorted, without duplicates
	expiration     time.Duration
}

// parseRequest validates req and clamps its expiration to [minExp, maxExp];
// zero means maxExp. A spoke token may not carry brokerAudience, which would
// let it pass for a consumer's hub token wherever the hub trusts the spoke's
// issuer. Errors wrap errdefs.ErrInvalidArgument.
func parseRequest(req *pb.ExchangeRequest, brokerAudience string, minExp, maxExp time.Duration) (request, error) {
	var r request
	var err error
	if r.cluster, err = parseRef("cluster", req.GetCluster(), validation.IsDNS1123Subdomain); err != nil {
		return r, err
	}
	if req.GetServiceAccount() != nil {
		if r.serviceAccount, err = parseRef("service_account", req.GetServiceAccount(), validation.IsDNS1123Subdomain); err != nil {
			return r, err
		}
	}
	if len(req.GetAudiences()) > maxAudiences {
		return r, fmt.Errorf("audiences: %d given, at most %d allowed: %w", len(req.GetAudiences()), maxAudiences, errdefs.ErrInvalidArgument)
	}
	for i, a := range req.GetAudiences() {
		if !validAudience(a) {
			return r, fmt.Errorf("audiences[%d]: want 1 to %d printable characters: %w", i, maxAudienceLength, errdefs.ErrInvalidArgument)
		}
		if a == brokerAudience {
			return r, fmt.Errorf("audiences[%d]: %q is the broker's own audience and never goes into a spoke token: %w", i, a, errdefs.ErrInvalidArgument)
		}
	}
	r.audiences = sortedSet(req.GetAudiences())

	switch secs := req.GetExpirationSeconds(); {
	case secs < 0:
		return r, fmt.Errorf("expiration_seconds: %d is negative; send 0 for the maximum (%s): %w", secs, maxExp, errdefs.ErrInvalidArgument)
	case secs == 0 || secs > int64(maxExp/time.Second):
		r.expiration = maxExp
	default:
		r.expiration = max(time.Duration(secs)*time.Second, minExp)
	}
	return r, nil
}

func parseRef(field string, ref *pb.ObjectReference, isName func(string) []string) (types.NamespacedName, error) {
	if ref == nil {
		return types.NamespacedName{}, fmt.Errorf("%s is required: %w", field, errdefs.ErrInvalidArgument)
	}
	if msg := invalid(ref.GetNamespace(), validation.IsDNS1123Label); msg != "" {
		return types.NamespacedName{}, fmt.Errorf("%s.namespace %q: %s: %w", field, clip(ref.GetNamespace()), msg, errdefs.ErrInvalidArgument)
	}
	if msg := invalid(ref.GetName(), isName); msg != "" {
		return types.NamespacedName{}, fmt.Errorf("%s.name %q: %s: %w", field, clip(ref.GetName()), msg, errdefs.ErrInvalidArgument)
	}
	return types.NamespacedName{Namespace: ref.GetNamespace(), Name: ref.GetName()}, nil
}

// invalid returns the first of check's complaints about s, or "" when it
// has none. check is apimachinery's validation of a DNS label or
// subdomain, both of which accept every DNS label: isLabel accepts most
// names without check's regular expression, which a cached exchange
// would otherwise run twice.
func invalid(s string, check func(string) []string) string {
	if isLabel(s) {
		return ""
	}
	if errs := check(s); len(errs) > 0 {
		return errs[0]
	}
	return ""
}

// isLabel reports whether s is a DNS label (RFC 1123): 1 to 63 lowercase
// letters, digits and '-', starting and ending with a letter or digit. It
// may be stricter than validation.IsDNS1123Label, never laxer
// (FuzzIsLabel).
func isLabel(s string) bool {
	if len(s) == 0 || len(s) > validation.DNS1123LabelMaxLength {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= '0' && c <= '9' {
			continue
		}
		if c != '-' || i == 0 || i == len(s)-1 {
			return false
		}
	}
	return true
}

// maxClip is how many bytes of a caller's string clip keeps.
const maxClip = 64

// clip keeps error messages short when a caller sends a huge name.
func clip(s string) string {
	if len(s) > maxClip {
		return s[:maxClip] + "..."
	}
	return s
}

// validAudience reports whether a is 1 to maxAudienceLength bytes without
// control characters: an audience a request may ask for, or an agent's
// answer may carry.
func validAudience(a string) bool {
	return a != "" && len(a) <= maxAudienceLength && !strings.ContainsFunc(a, isControl)
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

// sortedSet returns values sorted and without duplicates: values itself
// when it is so already (most requests name one audience or none), which
// the caller then must not change, or else a sorted copy.
func sortedSet(values []string) []string {
	for i := 1; i < len(values); i++ {
		if values[i-1] >= values[i] {
			return slices.Compact(slices.Sorted(slices.Values(values)))
		}
	}
	return values
}
