package grants

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// pendingRecord is the JSON value of one pending revoke in the ConfigMap:
// nothing secret, only what the revoke needs.
type pendingRecord struct {
	CredentialID string    `json:"credentialID"`
	Cluster      string    `json:"cluster"`
	ClusterUID   string    `json:"clusterUID,omitempty"`
	Expires      time.Time `json:"expires"`
	Reason       string    `json:"reason,omitempty"`
}

// maxPendingRecord bounds one record's value.
const maxPendingRecord = 2048

// pendingKey is the ConfigMap key of the revoke of id: a hash, since a
// credential id may hold characters that keys may not.
func pendingKey(id string) string {
	sum := sha256.Sum256([]byte(id))
	return "r." + hex.EncodeToString(sum[:16])
}

// encode returns the key, value and ClusterProfile (namespace/name) of p,
// whose expiry it bounds by MaxLifetime from now, and whose reason it
// cleans, and an empty key for a revoke without a credential id or of a
// token that has expired. It fails, with errdefs.ErrInvalidArgument, for a
// revoke whose record decode would not read back.
func (s *PendingStore) encode(p PendingRevoke, now time.Time) (string, string, string, error) {
	g := p.Grant
	id := g.GetCredentialId()
	exp := g.GetExpirationTime().AsTime()
	if id == "" || !exp.After(now) {
		return "", "", "", nil
	}
	rec := pendingRecord{
		CredentialID: id,
		Cluster:      g.GetCluster().GetNamespace() + "/" + g.GetCluster().GetName(),
		ClusterUID:   g.GetClusterUid(),
		Expires:      minTime(exp, now.Add(s.cfg.MaxLifetime)).UTC(),
		Reason:       cleanReason(p.Reason),
	}
	key := pendingKey(id)
	var buf strings.Builder
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	err := enc.Encode(rec)
	value := strings.TrimSuffix(buf.String(), "\n")
	if err == nil {
		err = checkRecord(key, value, rec)
	}
	if err != nil {
		return "", "", "", fmt.Errorf("the revoke of %s on ClusterProfile %s cannot be recorded: %w: %w", selector.Clip(id), selector.Clip(rec.Cluster), err, errdefs.ErrInvalidArgument)
	}
	return key, value, rec.Cluster, nil
}

// cleanReason drops what decode refuses from reason: bytes that are not
// UTF-8 and control characters, and clips it to maxReasonLength bytes on a
// rune boundary.
func cleanReason(reason string) string {
	reason = strings.ToValidUTF8(reason, "")
	reason = strings.Map(func(r rune) rune {
		if selector.IsControl(r) {
			return -1
		}
		return r
	}, reason)
	if len(reason) <= maxReasonLength {
		return reason
	}
	// reason is valid UTF-8, so reason[0] starts a rune and the loop ends.
	cut := maxReasonLength
	for !utf8.RuneStart(reason[cut]) {
		cut--
	}
	return reason[:cut]
}

// checkRecord is the check of a record that encode makes before it writes
// one and decode makes when it reads one: what encode writes, decode reads
// back.
func checkRecord(key, value string, rec pendingRecord) error {
	ns, name, _ := strings.Cut(rec.Cluster, "/")
	switch {
	case len(value) > maxPendingRecord:
		return errors.New("record too long")
	case key != pendingKey(rec.CredentialID):
		return errors.New("key does not match the credential id")
	case !selector.IsCredentialID(rec.CredentialID):
		return errors.New("not a credential id")
	case len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0:
		return errors.New("not a ClusterProfile")
	case len(rec.ClusterUID) > 128:
		return errors.New("ClusterProfile UID too long")
	case len(rec.Reason) > maxReasonLength || !utf8.ValidString(rec.Reason) || strings.ContainsFunc(rec.Reason, selector.IsControl):
		return errors.New("reason too long or not text")
	}
	return nil
}

// decode reads one record. It returns an error for a record that is not
// one this package writes, and a PendingRevoke without a Grant for one that
// has expired. A record's expiry is bounded by MaxLifetime from now.
func (s *PendingStore) decode(key, value string, now time.Time) (PendingRevoke, error) {
	if len(value) > maxPendingRecord {
		return PendingRevoke{}, errors.New("record too long")
	}
	var rec pendingRecord
	if err := json.Unmarshal([]byte(value), &rec); err != nil {
		return PendingRevoke{}, err
	}
	if err := checkRecord(key, value, rec); err != nil {
		return PendingRevoke{}, err
	}
	if !rec.Expires.After(now) {
		return PendingRevoke{}, nil
	}
	ns, name, _ := strings.Cut(rec.Cluster, "/")
	exp := minTime(rec.Expires, now.Add(s.cfg.MaxLifetime))
	return PendingRevoke{
		Grant: &pb.Grant{
			CredentialId:   rec.CredentialID,
			Cluster:        &pb.ObjectReference{Namespace: ns, Name: name},
			ClusterUid:     rec.ClusterUID,
			ExpirationTime: timestamppb.New(exp),
		},
		Reason: rec.Reason,
	}, nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func dataSize(data map[string]string) int {
	n := 0
	for k, v := range data {
		n += len(k) + len(v)
	}
	return n
}
