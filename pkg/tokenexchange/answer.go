package tokenexchange

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// minted is an agent's answer that passed the broker's checks, with the
// claims that were checked. Audit lines and answers to consumers use these
// claims, not what the agent said beside the token.
type minted struct {
	token          string
	serviceAccount types.NamespacedName // from sub
	audiences      []string             // aud
	expiry         time.Time            // exp
	credentialID   string               // from jti
}

// answerError says which of the broker's checks an agent's answer failed.
type answerError struct {
	check  string // sub, aud, exp, expiration_time, service_account or claims
	detail string
}

func (e *answerError) Error() string { return e.check + ": " + e.detail }

func failed(check, format string, args ...any) error {
	return &answerError{check: check, detail: fmt.Sprintf(format, args...)}
}

// checkOf names the check that err failed.
func checkOf(err error) string {
	if ae, ok := errors.AsType[*answerError](err); ok {
		return ae.check
	}
	return "unknown"
}

const serviceAccountPrefix = "system:serviceaccount:"

// checkAnswer reads the claims of the token an agent returned for request r,
// unverified (the broker does not hold the spoke's keys), and checks that
// the token is what was asked for and what the agent says it is:
//
//   - the answer names a valid ServiceAccount, the requested one when one was
//     named, and sub is system:serviceaccount:<namespace>:<name> of it;
//   - aud equals the requested audiences as a set, or, when none were
//     requested (the spoke's defaults), holds 1 to maxAudiences printable
//     audiences, none of them brokerAudience (which no request may ask for);
//   - exp lies in (now, now + maxExp + fleet.MaxClockSkew];
//   - expiration_time is exp, or up to fleet.MaxClockSkew before it, since
//     kube-apiserver reads its clock for the status when the request
//     arrives and for exp when it signs the token, seconds apart under load.
//
// Errors are *answerError and never contain the token.
func checkAnswer(resp *pb.MintResponse, r request, brokerAudience string, now time.Time, maxExp time.Duration) (minted, error) {
	c, err := token.ParseClaims(resp.GetToken())
	if err != nil {
		return minted{}, failed("claims", "%v", err)
	}

	// The answer's ServiceAccount must be one a request could name.
	// parseRef's error speaks to a consumer about its request, so the
	// agent's answer gets its own.
	sa, err := parseRef("service_account", resp.GetServiceAccount(), validation.IsDNS1123Subdomain)
	if err != nil {
		ref := resp.GetServiceAccount()
		return minted{}, failed("service_account", "the answer names no valid ServiceAccount (%q)", clip(ref.GetNamespace()+"/"+ref.GetName()))
	}
	if r.serviceAccount != (types.NamespacedName{}) && sa != r.serviceAccount {
		return minted{}, failed("service_account", "the answer names ServiceAccount %s, not the requested %s", sa, r.serviceAccount)
	}
	if want := serviceAccountPrefix + sa.Namespace + ":" + sa.Name; c.Subject != want {
		return minted{}, failed("sub", "sub %q is not %q, the ServiceAccount the answer names", clip(c.Subject), want)
	}

	if len(r.audiences) > 0 {
		if got := slices.Compact(slices.Sorted(slices.Values(c.Audiences))); !slices.Equal(got, r.audiences) {
			return minted{}, failed("aud", "aud %q is not the requested %q", clipAll(c.Audiences), r.audiences)
		}
	} else {
		if len(c.Audiences) == 0 || len(c.Audiences) > maxAudiences {
			return minted{}, failed("aud", "aud has %d audiences; want 1 to %d", len(c.Audiences), maxAudiences)
		}
		for _, a := range c.Audiences {
			if !validAudience(a) {
				return minted{}, failed("aud", "aud %q is not 1 to %d printable characters", clip(a), maxAudienceLength)
			}
			if a == brokerAudience {
				return minted{}, failed("aud", "aud holds %q, the broker's own audience", a)
			}
		}
	}

	latest := now.Add(maxExp + fleet.MaxClockSkew)
	switch {
	case c.Expiry.IsZero():
		return minted{}, failed("exp", "the token has no exp")
	case !c.Expiry.After(now):
		return minted{}, failed("exp", "exp %s is not after now (%s)", rfc3339(c.Expiry), rfc3339(now))
	case c.Expiry.After(latest):
		return minted{}, failed("exp", "exp %s is later than %s, the maximum expiration %s and %s of clock skew from now",
			rfc3339(c.Expiry), rfc3339(latest), maxExp, fleet.MaxClockSkew)
	}

	et := resp.GetExpirationTime()
	if err := et.CheckValid(); err != nil {
		return minted{}, failed("expiration_time", "expiration_time is missing or invalid")
	}
	// kube-apiserver takes the status's time when the request arrives,
	// before admission and the live GET of the bound object, and exp's
	// when it signs: seconds apart on a loaded API server. An earlier
	// expiration_time harms nobody (consumers get exp); a later one is
	// refused.
	if s := et.GetSeconds(); s > c.Expiry.Unix() || s < c.Expiry.Add(-fleet.MaxClockSkew).Unix() {
		return minted{}, failed("expiration_time", "expiration_time %s is not exp %s, nor less than %s before it",
			rfc3339(et.AsTime()), rfc3339(c.Expiry), fleet.MaxClockSkew)
	}

	return minted{
		token:          resp.GetToken(),
		serviceAccount: sa,
		audiences:      c.Audiences,
		expiry:         c.Expiry,
		credentialID:   token.IDOf(c, resp.GetToken()),
	}, nil
}

func rfc3339(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// clipAll clips each of the first maxAudiences strings of ss and drops the
// rest, for logs and errors that quote audiences not yet validated.
func clipAll(ss []string) []string {
	out := make([]string, 0, min(len(ss), maxAudiences))
	for _, s := range ss[:cap(out)] {
		out = append(out, clip(s))
	}
	return out
}
